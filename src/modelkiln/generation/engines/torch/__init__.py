"""The torch engine: a Llama-family decoder on the CPU or a CUDA device, its ops and its KV cache."""
