"""Triton python model ``<name>_model``: runs the variant its config names (parameter ``variant``)
with the engine kiln serve would use for it (runtime/registry.py): onnxruntime for ONNX variants
(for Triton images without the onnxruntime backend, e.g. the tritonserver in the ``nvidia-pytriton``
wheel), OpenVINO for the openvino-* variants, which no Triton backend here runs as kiln does.
Triton's dynamic batcher hands over several requests at once; they are run as one engine call,
which is the point of batching."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.registry import ONNX, engine_kind, open_encoder  # noqa: E402
from modelkiln.tasks import make_task  # noqa: E402
from modelkiln.triton.batching import split, stack  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.manifest = Manifest.load(HERE)
        self.per_token = make_task(self.manifest).info.per_token
        parameters = json.loads(args["model_config"]).get("parameters", {})
        threads = int(parameters.get("intra_op_thread_count", {}).get("string_value", "0") or 0)
        variant = self.manifest.variant(parameters["variant"]["string_value"])
        if args.get("model_instance_kind") == "GPU" and engine_kind(variant) == ONNX:
            variant.device = "cuda"  # an instance of kind GPU runs an ONNX variant with CUDA
        self.engine = open_encoder(HERE, self.manifest, variant, threads or None)
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
