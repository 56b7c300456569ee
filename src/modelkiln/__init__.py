"""modelkiln: Hugging Face transformers → validated fast ONNX variants, benchmarked and served."""

__version__ = "0.1.0"
