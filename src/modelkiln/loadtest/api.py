"""``run_loadtest``: everything ``kiln loadtest`` does short of printing, for the CLI and ``kiln tune``."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from datetime import datetime, timezone

from ..errors import KilnError
from . import inputs as text_inputs
from .client import fetch, parse_url, render_request, run_async
from .protocols import InputLayout, PreparedRequest, make_protocol
from .runner import Load, Measurement, RunConfig, RunResult, StepResult, model_metadata, run_step
from .streaming import build_requests, is_generation

if TYPE_CHECKING:
    from .check import Checker

MAX_BODIES = 4096  # distinct request bodies pre-built per run (cycled); bounds memory for big files
GENERATION_PROMPTS = 32  # generation: distinct prompts per run unless --max-inputs (--check takes each alone first)


@dataclass(frozen=True, kw_only=True)
class LoadtestOptions(Measurement):
    url: str
    model: str
    loads: tuple[Load, ...]
    protocol: str = "oip-json"
    grpc_url: str | None = None  # host:port for --protocol grpc (default: the URL's host, port 8001)
    inputs: str | None = None  # samples | sts | squad | FILE
    length: str = "all"
    batch: int = 1
    max_inputs: int | None = None
    metrics_url: str | None = "auto"  # auto: URL/metrics; None: none
    label: str | None = None
    stop_p99_ms: float | None = None  # stop the sweep after the first step above this p99
    max_tokens: int | None = None  # generation: tokens per answer (None: the server's default)
    ignore_eos: bool = False  # generation: fixed lengths (max_tokens each) rather than natural ones
    extra_inputs: tuple[tuple[str, Any], ...] = ()  # generation: more fields in every request body
    sampled: bool = False  # generation: temperature 0.7, top_p 0.95, a seed per prompt (streaming.SAMPLED)
    check: bool = False  # compare every answer with its request's reference taken alone (check.py)

    @property
    def generation(self) -> bool:
        return is_generation(self.protocol)


def parse_extra_input(value: str) -> tuple[str, Any]:
    """genai-perf's ``--extra-inputs NAME:VALUE``: VALUE as JSON when it is JSON, else as text."""
    name, sep, text = value.partition(":")
    if not sep or not name.strip():
        raise KilnError(f"--extra-inputs takes 'name:value', got '{value}'")
    try:
        return name.strip(), json.loads(text)
    except ValueError:
        return name.strip(), text


def parse_header(value: str) -> tuple[str, str]:
    name, sep, val = value.partition(":")
    if not sep or not name.strip():
        raise KilnError(f"--header takes 'Name: value', got '{value}'")
    return name.strip(), val.strip()


def run_loadtest(opts: LoadtestOptions, on_step: Callable[[StepResult], None] | None = None,
                 on_window: Callable[[Load, int, float, float], None] | None = None) -> RunResult:
    return run_async(lambda: _run(opts, on_step, on_window))


async def prepare(opts: LoadtestOptions) -> tuple[list[PreparedRequest], int]:
    """The request bodies a run cycles through (also used by benchmarks/serving/loadtest_compare.py to
    feed wrk and hey the very same bytes) and the number of texts they came from."""
    host, port, prefix = parse_url(opts.url)
    base = f"http://{host}:{port}{prefix}"
    if opts.generation:  # one prompt per request; a SQuAD (question, context) pair makes one prompt
        await fetch(base + "/", headers=opts.headers)  # any answer will do: nothing listening is one line, not a table
        items = text_inputs.select(text_inputs.load_items(opts.inputs, question_answering=True), opts.length,
                                   opts.max_inputs if opts.max_inputs is not None else GENERATION_PROMPTS, opts.seed)
        return build_requests(opts.protocol, opts.model, items, opts.max_tokens, opts.ignore_eos,
                              opts.extra_inputs, opts.sampled), len(items)
    metadata = await model_metadata(base, opts.model, opts.headers)
    if metadata is None:
        print(f"warning: no metadata for model '{opts.model}' at {base}; sending TEXT with shape [n]",
              file=sys.stderr)
        layout = InputLayout()
    else:
        layout = InputLayout.from_metadata(metadata)
    items = text_inputs.select(text_inputs.load_items(opts.inputs, question_answering=layout.question_answering),
                               opts.length, opts.max_inputs, opts.seed)
    protocol = make_protocol(opts.protocol, opts.model, layout)
    count = max(1, min(MAX_BODIES, math.ceil(len(items) / opts.batch)))
    return [protocol.build(b) for b in text_inputs.batches(items, opts.batch, count)], len(items)


async def _run(opts: LoadtestOptions, on_step: Callable[[StepResult], None] | None,
               on_window: Callable[[Load, int, float, float], None] | None) -> RunResult:
    host, port, prefix = parse_url(opts.url)
    base = f"http://{host}:{port}{prefix}"
    prepared, texts = await prepare(opts)
    grpc = opts.protocol == "grpc"
    if grpc:
        from .grpc_load import grpc_target
    raws = [p.body if grpc else render_request("POST", host, port, prefix + p.path, p.body,
                                               (*p.headers, *opts.headers)) for p in prepared]
    metrics_url = (f"{base}/metrics" if opts.metrics_url == "auto" else
                   None if opts.metrics_url in (None, "", "none") else opts.metrics_url)
    route = {"task": "predict", "openai-chat": "chat_completions", "openai-completions": "completions",
             "generate": "generate"}.get(opts.protocol, "infer")
    cfg = RunConfig(**opts.measurement(), url=base, model=opts.model, metrics_url=metrics_url, route=route,
                    grpc_target=grpc_target(opts.url, opts.grpc_url) if grpc else None, protocol=opts.protocol)
    source = opts.inputs or "samples"
    checker: Checker | None = None
    if opts.check:
        from . import check

        if opts.generation:
            checker = await check.generation_references(base, raws, opts.protocol, opts.timeout_s, opts.max_tokens,
                                                        opts.ignore_eos)
        else:
            checker = await check.encoder_references(base, raws, opts.protocol, opts.timeout_s,
                                                     cfg.grpc_target, opts.headers)
    result = RunResult(label=opts.label or f"{opts.model}@{host}:{port}", url=base, model=opts.model,
                       protocol=opts.protocol, inputs=f"{source}, {opts.length}, {texts} texts",
                       batch=opts.batch, started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       max_tokens=opts.max_tokens if opts.generation else None,
                       ignore_eos=opts.ignore_eos if opts.generation else None, check=opts.check,
                       sampled=opts.sampled if opts.generation else None)
    for load in opts.loads:
        window_cb = (lambda i, t, p, load=load: on_window(load, i, t, p)) if on_window else None
        step = await run_step(cfg, load, raws, opts.batch, window_cb, checker)
        result.steps.append(step)
        if on_step is not None:
            on_step(step)
        if step.requests == 0 and sum(step.errors.values()) > 0 and not step.answered.get("200"):
            break  # nothing succeeds: more load will not help
        if opts.stop_p99_ms is not None and step.latency is not None and step.latency.p99 > opts.stop_p99_ms:
            break
    if checker is not None:
        result.mismatch_examples = list(checker.examples)
    return result
