"""``kiln triton``: an artifact → a Triton Inference Server model repository (tokenize → model →
postprocess, joined by an ensemble), plus a launcher for the tritonserver that ships in the
``nvidia-pytriton`` wheel.

Kept import-free on purpose: ``names``, ``protocol`` and ``batching`` are copied into the
generated repository and imported inside Triton's python backend, where only numpy and
tokenizers (and onnxruntime for the python-backend model) can be assumed."""
