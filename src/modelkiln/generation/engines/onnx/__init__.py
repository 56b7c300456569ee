"""The two ONNX Runtime engines: the serving graph's and the padded export's, on a shared base."""
