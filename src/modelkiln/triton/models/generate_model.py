"""Triton python model ``<name>``: text generation with modelkiln's engine, decoupled (streaming).

Inputs follow Triton's generate extension (``/v2/models/<name>/generate`` and ``generate_stream``
map the JSON body's fields onto inputs of the same name): ``text_input`` and the optional sampling
inputs (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``seed``,
``ignore_eos``), plus ``stream``: true sends one response per piece of text, false (default) one
response with the whole answer, which is what ``/generate`` needs. The same names are read from
the request's parameters too (``"parameters": {...}`` in the JSON body), the tensors winning.

Requests are batched across one another by modelkiln's engine core (the one ``kiln serve``
runs: admission, chunked prefill, decode steps); a thread steps it and ``execute`` only hands
requests to it. Runs the project's own code from the modelkiln snapshot next to this file."""

import json
import logging
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.errors import KilnError  # noqa: E402
from modelkiln.generation.core import EngineCore, Request  # noqa: E402
from modelkiln.generation.model import TextGenerationModel  # noqa: E402

log = logging.getLogger("modelkiln.triton")

# input name → (SamplingParams field, type)
SAMPLING_INPUTS = {"max_tokens": ("max_new_tokens", int), "temperature": ("temperature", float),
                   "top_k": ("top_k", int), "top_p": ("top_p", float),
                   "repetition_penalty": ("repetition_penalty", float), "seed": ("seed", int),
                   "ignore_eos": ("ignore_eos", bool)}


class Job(Request):
    """A request, how it answers (``sender``, streamed or whole) and what it has said so far."""

    def __init__(self, request_id, prompt_ids, params, sender, stream):
        super().__init__(request_id, prompt_ids, params)
        self.sender = sender
        self.stream = stream
        self.pieces = []


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        threads = int(parameters.get("threads") or 0) or None
        max_batch = int(parameters.get("max_batch") or 32)
        self.model = TextGenerationModel(HERE)
        engine = self.model.engine(parameters.get("variant") or None, threads, max_rows=max_batch)
        self.core = EngineCore(engine, self.model.tokenizer, self.model.eos_ids, max_running=max_batch)
        self.ids = iter(range(1, 1 << 62))
        self.wake = threading.Condition()
        self.running = True
        self.scheduler = threading.Thread(target=self._schedule, name="kiln-generate", daemon=True)
        self.scheduler.start()

    # -- requests ------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._job(request, sender)
                with self.wake:
                    self.core.add_request(job)
                    self.wake.notify()
            except (KilnError, ValueError, TypeError, UnicodeDecodeError) as exc:  # the request's fault: 400
                error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None  # decoupled: answers go through the senders

    def _job(self, request, sender):
        text = _scalar(request, "text_input")
        if text is None:
            raise ValueError("text_input is required")
        prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        given = json.loads(request.parameters() or "{}")
        overrides = {}
        for name, (field, kind) in SAMPLING_INPUTS.items():
            value = _scalar(request, name)
            value = given.get(name) if value is None else value
            if value is not None:
                overrides[field] = kind(value)
        stream = _scalar(request, "stream")
        stream = bool(given.get("stream", False) if stream is None else stream)
        params = self.model.default_params(**overrides)
        return Job(next(self.ids), self.model.prompt_ids(prompt), params, sender, stream)

    # -- the scheduler thread -------------------------------------------------------------------
    def _schedule(self):
        while True:
            with self.wake:
                while self.running and not self.core.has_work():
                    self.wake.wait()
                if not self.running:
                    return
            for part in self.core.step_parts():  # the core fails its own requests on an engine error
                for output in part:  # first tokens go out before the decode step
                    try:
                        self._answer(output)
                    except Exception:  # a client gone or a bad response: that request only, the thread goes on
                        log.exception("could not answer generation request %s", output.request_id)

    def _answer(self, output):
        job = output.request
        if output.error is not None:
            self._fail(job, output.error)
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
        with self.wake:
            self.running = False
            self.wake.notify()
        self.scheduler.join(timeout=10)


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value
