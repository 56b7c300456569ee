"""Running artifacts: tokenizer, engines, and the pipeline that joins them to a task."""

from .engine import Engine
from .onnx import OnnxEngine
from .pipeline import Pipeline, load_pipeline
from .tokenizer import TextEncoder

__all__ = ["Engine", "OnnxEngine", "Pipeline", "TextEncoder", "load_pipeline"]
