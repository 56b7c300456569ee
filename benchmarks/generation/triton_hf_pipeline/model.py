"""Triton's python backend running a Hugging Face ``pipeline("text-generation")``, as in Triton's
"Deploying Hugging Face Transformer Models" tutorial (Quick_Deploy/HuggingFaceTransformers): one
pipeline per model instance, ``text_input`` in, ``text_output`` out, one request at a time, no
streaming (the whole answer comes back as one response, so one generate_stream event).

The tutorial's model reads a fixed ``max_output_length`` from the model config; this one also reads
the request's ``max_tokens`` and ``ignore_eos`` parameters (what `kiln loadtest --protocol
generate` sends) so that every server answers the same number of tokens: ``ignore_eos`` becomes
``min_new_tokens = max_tokens``. It returns ``completion_tokens`` and ``finish_reason`` too, as
kiln serve's generate_stream does, so the load tester can count tokens (one event carries them
all) and sees the stream end. Greedy (``do_sample=False``) like the others.

generation_servers.py copies this folder into a temporary repository with a config.pbtxt that
names the Hugging Face model folder (``huggingface_model``) and the torch threads."""

import json

import numpy as np
import torch
import transformers
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        folder = params["huggingface_model"]["string_value"]
        torch.set_num_threads(int(params["torch_threads"]["string_value"]))
        self.default_max_tokens = int(params["max_output_length"]["string_value"])
        self.pipeline = transformers.pipeline("text-generation", model=folder, dtype=torch.float32, device="cpu")

    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
            settings = json.loads(request.parameters() or "{}")
            max_tokens = int(settings.get("max_tokens", self.default_max_tokens))
            min_tokens = max_tokens if str(settings.get("ignore_eos", "false")).lower() == "true" else 0
            ids = self.pipeline(prompt, max_new_tokens=max_tokens, min_new_tokens=min_tokens, do_sample=False,
                                return_tensors=True)[0]["generated_token_ids"]  # the prompt's ids, then the answer's
            answer = ids[len(self.pipeline.tokenizer(prompt).input_ids):]
            text = self.pipeline.tokenizer.decode(answer, skip_special_tokens=True)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                pb_utils.Tensor("completion_tokens", np.array([len(answer)], dtype=np.int32)),
                pb_utils.Tensor("finish_reason", np.array([b"length" if len(answer) >= max_tokens else b"stop"],
                                                          dtype=np.object_))]))
        return responses
