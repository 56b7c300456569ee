"""Triton python model ``<name>_postprocess``: model outputs (+ the request's texts) in, the task's
answers out, through the project's own ``Task.postprocess``.

Why the texts come here too and are tokenized again: token classification and QA need the
tokenizer's ``Encoding`` objects (character offsets, sequence ids, special-token masks).
Re-tokenizing the same text with the same tokenizer.json gives exactly the encodings the
tokenize model used, so ``Task.postprocess`` runs unchanged on real encodings. Passing offsets
as extra tensors instead would need a second, hand-written stand-in for ``Encoding`` here,
which is the kind of copy that drifts. Tokenizing again costs well under a millisecond."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.errors import KilnError  # noqa: E402
from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.tokenizer import TextEncoder  # noqa: E402
from modelkiln.tasks import make_task  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.manifest = m = Manifest.load(HERE)
        self.task = make_task(m)
        self.encoder = TextEncoder.from_folder(HERE, m.tokenizer, m.input_names, m.max_length)
        self.text_names = [spec.name for spec in self.task.input_specs()]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = {}
                for name in self.text_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    texts[name] = tensor.as_numpy() if tensor is not None else None
                prepared = self.task.prepare(self.task.inputs_from_tensors(texts))
                encodings = self.encoder.tokenize(prepared)
                outputs = {n: _required(request, n) for n in self.manifest.output_names}
                answers = self.task.postprocess(outputs, encodings, prepared)
                tensors = self.task.answer_tensors(answers)
                # Triton's configs give per-example values dims [1]: [n] → [n, 1].
                out = [pb_utils.Tensor(n, v.reshape(len(answers), 1) if v.ndim == 1 else v) for n, v in tensors.items()]
                responses.append(pb_utils.InferenceResponse(out))
            except (KilnError, KeyError, ValueError) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses


def _required(request, name):
    """A required input's array: config.pbtxt declares it, so Triton refuses a request without it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    assert tensor is not None, name
    return tensor.as_numpy()
