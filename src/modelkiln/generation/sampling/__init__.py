"""The sampler: what a request asks for (``params``), each token's random draw (``draws``), the
choice among the candidates (``selection``), and the host engines' per-sequence chooser (``host``).
The torch engine's device sampler (``generation/sampling/device.py``) follows the same rules."""

from .draws import uniform, uniforms
from .host import TokenChooser, apply_repetition_penalty, log_softmax, token_logprobs
from .params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams", "TokenChooser", "apply_repetition_penalty",
           "log_softmax", "token_logprobs", "uniform", "uniforms"]
