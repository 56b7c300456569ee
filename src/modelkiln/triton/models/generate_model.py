"""Triton python model ``<name>``: text generation with modelkiln's engine, decoupled (streaming).

Inputs follow Triton's generate extension (``/v2/models/<name>/generate`` and ``generate_stream``
map the JSON body's fields onto inputs of the same name): ``text_input`` and the optional sampling
inputs (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``seed``,
``ignore_eos``), plus ``stream``: true sends one response per piece of text, false (default) one
response with the whole answer, which is what ``/generate`` needs. The same names are read from
the request's parameters too (``"parameters": {...}`` in the JSON body), the tensors winning.

Requests are batched across one another: a scheduler thread owns the ``GenerationEngine`` and,
between two decode steps, lets finished sequences leave and new ones join (prefill), as
``kiln generate``'s generator does; ``execute`` only hands requests to it. Runs the project's own
code from the modelkiln snapshot next to this file."""

import json
import os
import queue
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the snapshot this repository was generated with wins over any installed modelkiln

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402  (provided by Triton's python backend)

from modelkiln.errors import KilnError  # noqa: E402
from modelkiln.generation.engine import GenerationEngine  # noqa: E402
from modelkiln.generation.model import TextGenerationModel  # noqa: E402
from modelkiln.generation.sequence import SequenceState  # noqa: E402

# input name → (SamplingParams field, type)
SAMPLING_INPUTS = {"max_tokens": ("max_new_tokens", int), "temperature": ("temperature", float),
                   "top_k": ("top_k", int), "top_p": ("top_p", float),
                   "repetition_penalty": ("repetition_penalty", float), "seed": ("seed", int),
                   "ignore_eos": ("ignore_eos", bool)}


class Job:
    """One request being generated: its state, how it answers, what it has said."""

    def __init__(self, state, sender, stream):
        self.state = state
        self.sender = sender
        self.stream = stream
        self.pieces = []


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        threads = int(parameters.get("threads") or 0) or None
        self.max_batch = int(parameters.get("max_batch") or 32)
        self.model = TextGenerationModel(HERE)
        decoder = self.model.decoder(parameters.get("variant") or None, threads)
        self.engine = GenerationEngine(decoder, self.model.max_context)
        self.eos_ids = frozenset(self.model.eos_ids)
        self.inbox = queue.Queue()
        self.ids = iter(range(1, 1 << 62))
        self.running = True
        self.scheduler = threading.Thread(target=self._schedule, name="kiln-generate", daemon=True)
        self.scheduler.start()

    # -- requests ------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._job(request, sender)
            except (KilnError, ValueError, TypeError, UnicodeDecodeError) as exc:  # the request's fault: 400
                error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.inbox.put(job)
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
        prompt_ids = self.model.prompt_ids(prompt)
        state = SequenceState(next(self.ids), prompt_ids, params, self.model.tokenizer, self.eos_ids,
                              self.model.max_context)
        return Job(state, sender, stream)

    # -- the scheduler thread -------------------------------------------------------------------
    def _schedule(self):
        running = {}  # sequence id → Job
        next_tokens = {}
        while self.running:
            try:
                # idle: wait for work; busy: take whatever arrived since the last step
                job = self.inbox.get(timeout=0.5) if not running else self.inbox.get_nowait()
            except queue.Empty:
                job = None
            while job is not None:
                if job is _STOP:
                    return
                self._join(job, running, next_tokens)
                if len(running) >= self.max_batch:
                    break
                try:
                    job = self.inbox.get_nowait()
                except queue.Empty:
                    job = None
            if running:
                try:
                    logits = self.engine.step(next_tokens)
                except Exception as exc:  # the whole batch fails alike; the engine is reset by removal
                    for seq_id, failed in list(running.items()):
                        self._fail(failed, exc)
                        self.engine.remove(seq_id)
                    running.clear()
                    next_tokens.clear()
                    continue
                for row, seq_id in enumerate(list(self.engine.rows)):
                    self._advance(running[seq_id], logits[row], running, next_tokens)

    def _join(self, job, running, next_tokens):
        state = job.state
        try:
            logits = self.engine.add(state.request_id, state.prompt_ids)
        except Exception as exc:  # a prompt longer than the context, ...: this request only
            if state.request_id in self.engine:
                self.engine.remove(state.request_id)
            self._fail(job, exc)
            return
        running[state.request_id] = job
        self._advance(job, logits, running, next_tokens)

    def _advance(self, job, logits, running, next_tokens):
        state = job.state
        token = state.choose(logits)
        delta = state.accept(token)
        if state.finished:
            running.pop(state.request_id, None)
            next_tokens.pop(state.request_id, None)
            self.engine.remove(state.request_id)
        else:
            next_tokens[state.request_id] = token
        if job.stream:
            if delta.text or state.finished:
                self._send(job, delta.text, state.finished)
        else:
            job.pieces.append(delta.text)
            if state.finished:
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
        self.running = False
        self.inbox.put(_STOP)
        self.scheduler.join(timeout=10)


_STOP = object()


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value
