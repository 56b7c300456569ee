"""Triton python model ``<name>_tokenize``: text tensors in, the ONNX model's int64 inputs out.

Runs the project's own code (``Task.prepare``, ``TextEncoder``) from the modelkiln snapshot
next to this file; needs only numpy and tokenizers."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.errors import KilnError  # noqa: E402
from modelkiln.manifest import Manifest  # noqa: E402
from modelkiln.runtime.tokenizer import TextEncoder  # noqa: E402
from modelkiln.tasks import make_task  # noqa: E402
from modelkiln.triton.batching import bucket_width  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.manifest = Manifest.load(HERE)
        self.task = make_task(self.manifest)
        m = self.manifest
        self.encoder = TextEncoder.from_folder(HERE, m.tokenizer, m.input_names, m.max_length)
        self.input_names = [spec.name for spec in self.task.input_specs()]
        # Bucket widths let the onnxruntime/TensorRT backends batch requests of similar length;
        # the python-backend model batches any widths, so there each request keeps its own
        # (the pipeline's padding, hence the pipeline's exact numbers, int8 included).
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.buckets = parameters.get("pad_to_buckets", {}).get("string_value", "true") == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    tensors[name] = tensor.as_numpy() if tensor is not None else None
                prepared = self.task.prepare(self.task.inputs_from_tensors(tensors))
                encodings = self.encoder.tokenize(prepared)
                longest = max(len(e.ids) for e in encodings)
                feeds = self.encoder.collate(encodings, pad_to=bucket_width(longest, self.manifest.max_length) if self.buckets else None)
                out = [pb_utils.Tensor(name, feeds[name]) for name in self.manifest.input_names]
                responses.append(pb_utils.InferenceResponse(output_tensors=out))
            except (KilnError, KeyError, UnicodeDecodeError) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses
