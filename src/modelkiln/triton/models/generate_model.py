"""Triton python model ``<name>``: text generation with modelkiln's engine, decoupled (streaming).

Inputs follow Triton's generate extension (``/v2/models/<name>/generate`` and ``generate_stream``
map the JSON body's fields onto inputs of the same name): ``text_input`` and the optional sampling
inputs (every setting ``generation/request/settings.py`` declares), plus ``stream``: true sends one response per piece of text, false (default) one
response with the whole answer, which is what ``/generate`` needs. The same names are read from
the request's parameters too (``"parameters": {...}`` in the JSON body), the tensors winning.

Requests are batched across one another by modelkiln's engine core (the one ``kiln serve``
runs: admission, chunked prefill, decode steps); a thread steps it and ``execute`` only hands
requests to it. Runs the project's own code from the modelkiln snapshot next to this file."""

import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.errors import KilnError  # noqa: E402
from modelkiln.generation.core import DEFAULT_MAX_WAITING, DEFAULT_TIMEOUT_S, Request  # noqa: E402
from modelkiln.generation.driver import CoreDriver  # noqa: E402
from modelkiln.generation.model import CoreOptions, TextGenerationModel  # noqa: E402
from modelkiln.generation.speculation import DEFAULT_DRAFT_TOKENS, SpeculationOptions  # noqa: E402
from modelkiln.generation.request.params import sampling_params  # noqa: E402
from modelkiln.generation.request.settings import SETTINGS, from_tensor  # noqa: E402

log = logging.getLogger("modelkiln.triton")


class Job(Request):
    """A request, how it answers (``sender``, streamed or whole) and what it has said so far."""

    def __init__(self, request_id, prompt_ids, params, deadline, sender, stream):
        super().__init__(request_id, prompt_ids, params, deadline=deadline)
        self.sender = sender
        self.stream = stream
        self.pieces = []


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model = TextGenerationModel(HERE)
        self.timeout_s = float(parameters.get("timeout_s") or DEFAULT_TIMEOUT_S)
        options = CoreOptions(threads=int(parameters.get("threads") or 0) or None,
                              max_running=int(parameters.get("max_batch") or 32),
                              max_waiting=int(parameters.get("max_queue") or DEFAULT_MAX_WAITING), warm_up=True,
                              speculation=SpeculationOptions(parameters.get("speculate") or "off",
                                                             int(parameters.get("draft_tokens") or DEFAULT_DRAFT_TOKENS)))
        # the same core kiln serve builds: KV budget from what the engine's memory holds, the queue bound,
        # the prefill chunk, the prefix cache; one thread steps it (abort and deadlines included)
        core = self.model.core(parameters.get("variant") or None, options)
        self.driver = CoreDriver(core, self._deliver, name="triton")
        self.ids = iter(range(1, 1 << 62))
        self.driver.start()

    # -- requests ------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.driver.submit(self._job(request, sender))
            except (KilnError, ValueError, TypeError, UnicodeDecodeError) as exc:  # the request's fault: 400
                error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None  # decoupled: answers go through the senders

    def _job(self, request, sender):
        text = _scalar(request, "text_input")
        if text is None:
            raise ValueError("text_input is required")
        prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        fields = json.loads(request.parameters() or "{}")
        for setting in SETTINGS:  # read as the request's sampling fields, checked as kiln serve checks them
            tensor = pb_utils.get_input_tensor_by_name(request, setting.name)
            if tensor is not None:  # the tensors win over the parameters
                fields[setting.name] = from_tensor(setting, tensor.as_numpy().reshape(-1).tolist())
        stream_input = _scalar(request, "stream")
        stream = bool(fields.pop("stream", False) if stream_input is None else stream_input)
        ids = self.model.prompt_ids(prompt)
        context = self.model.max_context or self.model.manifest.max_length
        params = sampling_params(fields, self.model.default_params(), len(ids), context)
        return Job(next(self.ids), ids, params, time.monotonic() + self.timeout_s, sender, stream)

    # -- the driver thread's outputs ------------------------------------------------------------
    def _deliver(self, outputs):
        for output in outputs:
            try:
                self._answer(output)
            except Exception:  # a client gone or a bad response: that request only, the thread goes on
                log.exception("could not answer generation request %s", output.request_id)
                self.driver.cancel(output.request_id)

    def _answer(self, output):
        job = output.request
        if output.error is not None:
            self._fail(job, output.error)
            return
        if _cancelled(job.sender):  # the client went away: free its sequence at the next step
            self.driver.cancel(job.request_id)
            return
        delta = output.delta
        final = delta.finish_reason is not None
        if job.stream:
            if delta.text or final:
                self._send(job, delta.text, final)
        else:
            job.pieces.append(delta.text)
            if final:
                self._send(job, "".join(job.pieces), True)

    def _send(self, job, text, final):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if final:
            tensors.append(pb_utils.Tensor("finish_reason",
                                           np.array([job.state.finish_reason.encode()], dtype=np.object_)))
        job.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    @staticmethod
    def _fail(job, exc):
        job.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self.driver.stop(timeout=10)


def _cancelled(sender):
    is_cancelled = getattr(sender, "is_cancelled", None)  # Triton's python backend 23.10 and later
    return bool(is_cancelled()) if is_cancelled is not None else False


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value
