"""What the server says about a step: scrape its Prometheus ``/metrics`` before and after, diff.

Two dialects are understood:
- kiln serve: ``kiln_requests_total{model,route,status,protocol}``, ``kiln_queue_duration_seconds`` (per
  input), ``kiln_batch_compute_seconds`` (per batch), ``kiln_batch_size`` (histograms);
- Triton: ``nv_inference_request_success|failure``, ``nv_inference_count`` (inferences),
  ``nv_inference_exec_count`` (batches), ``nv_inference_queue_duration_us`` and
  ``nv_inference_compute_infer_duration_us`` (cumulative, per request), labelled by model. For
  an ensemble, queue and compute are the sums over its steps (the ensemble's own queue counter
  stays ~0), and the batch size is that of the step that computed longest (the model).
Anything else (MLServer, a proxy) gives no breakdown; the client-side numbers stand alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import KilnError

Key = tuple[str, tuple[tuple[str, str], ...]]
Snapshot = dict[Key, float]


def parse(text: str) -> Snapshot:
    """Prometheus text → {(sample name without "_total", sorted labels): value}, via prometheus_client."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise KilnError("reading server metrics needs prometheus-client (pip install prometheus-client), "
                        "or pass --metrics-url none") from None
    snapshot: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The parser appends "_total" to the samples of a typed counter (Triton's lack it) but
            # not to untyped ones: drop the suffix everywhere so lookups need one spelling.
            snapshot[(s.name.removesuffix("_total"), tuple(sorted(s.labels.items())))] = float(s.value)
    return snapshot


def dialect(snapshot: Snapshot) -> str | None:
    names = {name for name, _ in snapshot}
    if "kiln_requests" in names or "kiln_requests_in_flight" in names:
        return "kiln"
    if any(n.startswith("nv_inference_") for n in names):
        return "triton"
    return None


def _delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """Sum of (after - before) over samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lab), value in after.items():
        if n != name:
            continue
        d = dict(lab)
        if all(d.get(k) == v for k, v in labels.items()):
            total += value - before.get((n, lab), 0.0)
    return total


def _models(snapshot: Snapshot, name: str) -> set[str]:
    return {dict(lab).get("model", "") for n, lab in snapshot if n == name}


@dataclass
class ModelBreakdown:
    requests: float = 0.0  # requests that reached this model (Triton) / inputs batched (kiln)
    batches: float = 0.0
    queue_ms: float | None = None  # mean wait before execution, per request (Triton) or input (kiln)
    compute_ms: float | None = None  # mean per batch (kiln) / per request (Triton)
    batch_size: float | None = None  # mean inputs per batch


@dataclass
class ServerBreakdown:
    """Server-side view of one step (differences of two scrapes)."""

    kind: str  # kiln | triton
    success: int  # requests answered with success for the model (kiln: HTTP 200 on the route)
    failed: int
    by_status: dict[str, int] = field(default_factory=dict)  # kiln: per HTTP status, on the route
    queue_ms: float | None = None
    compute_ms: float | None = None
    batch_size: float | None = None
    models: dict[str, ModelBreakdown] = field(default_factory=dict)


def _ratio(a: float, b: float, scale: float = 1.0) -> float | None:
    return a / b * scale if b > 0 else None


def breakdown(before: Snapshot, after: Snapshot, model: str, route: str | None) -> ServerBreakdown | None:
    kind = dialect(after)
    if kind == "kiln":
        by_status: dict[str, int] = {}
        for (n, lab), value in after.items():
            d = dict(lab)
            if n == "kiln_requests" and d.get("model") == model and (route is None or d.get("route") == route):
                delta = int(round(value - before.get((n, lab), 0.0)))
                if delta:
                    by_status[d["status"]] = by_status.get(d["status"], 0) + delta
        inputs = _delta(before, after, "kiln_queue_duration_seconds_count", model=model)
        batches = _delta(before, after, "kiln_batch_compute_seconds_count", model=model)
        m = ModelBreakdown(
            requests=inputs, batches=batches,
            queue_ms=_ratio(_delta(before, after, "kiln_queue_duration_seconds_sum", model=model), inputs, 1e3),
            compute_ms=_ratio(_delta(before, after, "kiln_batch_compute_seconds_sum", model=model), batches, 1e3),
            batch_size=_ratio(_delta(before, after, "kiln_batch_size_sum", model=model),
                              _delta(before, after, "kiln_batch_size_count", model=model)),
        )
        ok = ("200", "OK")  # HTTP status or gRPC status code name
        return ServerBreakdown("kiln", success=sum(by_status.get(k, 0) for k in ok),
                               failed=sum(v for k, v in by_status.items() if k not in ok), by_status=by_status,
                               queue_ms=m.queue_ms, compute_ms=m.compute_ms, batch_size=m.batch_size,
                               models={model: m})
    if kind == "triton":
        models: dict[str, ModelBreakdown] = {}
        for name in _models(after, "nv_inference_request_success"):
            success = _delta(before, after, "nv_inference_request_success", model=name)
            execs = _delta(before, after, "nv_inference_exec_count", model=name)
            if success <= 0 and execs <= 0:
                continue
            models[name] = ModelBreakdown(
                requests=success, batches=execs,
                queue_ms=_ratio(_delta(before, after, "nv_inference_queue_duration_us", model=name), success, 1e-3),
                compute_ms=_ratio(_delta(before, after, "nv_inference_compute_infer_duration_us", model=name),
                                  success, 1e-3),
                batch_size=_ratio(_delta(before, after, "nv_inference_count", model=name), execs),
            )
        target = models.get(model, ModelBreakdown())
        steps = {n: m for n, m in models.items() if n != model}
        queue, compute, batched = target.queue_ms, target.compute_ms, target
        if steps:  # an ensemble: its compute sums its steps' but its queue is ~0, so sum the steps'
            queue = sum(m.queue_ms or 0.0 for m in steps.values())
            compute = sum(m.compute_ms or 0.0 for m in steps.values())
            batched = max(steps.values(), key=lambda m: (m.compute_ms or 0) * m.requests)
        return ServerBreakdown(
            "triton", success=int(round(target.requests)),
            failed=int(round(_delta(before, after, "nv_inference_request_failure", model=model))),
            queue_ms=queue, compute_ms=compute, batch_size=batched.batch_size, models=models)
    return None
