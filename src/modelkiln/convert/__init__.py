"""Hugging Face model → validated ONNX variants in an artifact folder (needs modelkiln[convert])."""
