"""A GGUF file's tensors and quantized blocks, as the serving graph and kiln's native operators take them."""
