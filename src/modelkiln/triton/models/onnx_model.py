"""Triton python model ``<name>_model`` for Triton images without the onnxruntime backend (e.g.
the tritonserver in the ``nvidia-pytriton`` wheel): runs ``model.onnx`` with the project's
``OnnxEngine``. Triton's dynamic batcher hands over several requests at once; they are run as
one onnxruntime call, which is the point of batching."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.onnx import OnnxEngine  # noqa: E402
from modelkiln.tasks import make_task  # noqa: E402
from modelkiln.triton.batching import split, stack  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.manifest = Manifest.load(HERE)
        self.per_token = make_task(self.manifest).info.per_token
        config = json.loads(args["model_config"])
        threads = int(config.get("parameters", {}).get("intra_op_thread_count", {}).get("string_value", "0") or 0)
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.engine = OnnxEngine(os.path.join(HERE, "model.onnx"), device=device, threads=threads or None)
        self.pad_values = {"input_ids": self.manifest.tokenizer.pad_token_id}

    def execute(self, requests):
        try:
            feeds = [
                {n: _required(r, n) for n in self.manifest.input_names}
                for r in requests
            ]
            batch, sizes = stack(feeds, self.pad_values)
            outputs = self.engine.run(batch)
        except Exception as exc:  # one failed batch fails each of its requests, not the server
            error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(n, v) for n, v in part.items()])
            for part in split(outputs, sizes, self.per_token)
        ]


def _required(request, name):
    """A required input's array: config.pbtxt declares it, so Triton refuses a request without it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    assert tensor is not None, name
    return tensor.as_numpy()
