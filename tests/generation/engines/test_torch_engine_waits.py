"""A torch-engine step waits on its device once: the chosen tokens (and each row's status) come to the
host in one copy (``engines/torch/transfers.py``, which counts them), and no operation that makes the
host wait implicitly runs during a step (``.item()``, ``nonzero``, a boolean index, ``bool(tensor)``,
``.tolist()`` or ``.numpy()`` of a step's tensor). Checked on the CPU, where nothing waits, through
the same code a GPU runs: decode steps (eager and through the decode graphs' buckets) and mixed
steps (prompt chunks beside decode rows), greedy and sampled rows, penalties and a grammar mask.

Rows that need logits on the host wait again, by design: log-probabilities (the chosen token's and
the top ones'), kept logits (the gate), a row whose best score overflowed."""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modelkiln.generation.core import Request, greedy, run_to_completion
from modelkiln.generation.engines.torch import transfers
from modelkiln.generation.engines.torch.engine import StepGraphs
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.structured_output import bitmask

# operators whose result the host must read before it can go on: each waits for the device
WAITING_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select",
               "unique", "_unique", "_unique2", "unique_consecutive", "equal", "allclose", "repeat_interleave"}


class WaitingOps(TorchDispatchMode):
    """Records every operator that makes the host wait for the device (a boolean mask as an index
    is a ``nonzero``), and every ``.tolist()``, ``.numpy()`` or ``.cpu()`` of a tensor called from
    anywhere but ``transfers.HostCopy.result`` (on a GPU each is a wait of its own). What runs inside an
    operator is the device's own (a custom kernel's CPU form reads its tensors: on CUDA a kernel runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._inside = 0  # operators being run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if name in WAITING_OPS or boolean_index:
            self.found.append(str(func))
        self._inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._inside -= 1

    @contextlib.contextmanager
    def host_reads(self):
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

        def counted(name):
            def read(tensor, *args, **kwargs):
                if not self._inside and sys._getframe(1).f_code is not transfers.HostCopy.result.__code__:
                    self.found.append(f"Tensor.{name}")
                return originals[name](tensor, *args, **kwargs)
            return read

        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def watched_steps(engine):
    """Wraps ``engine.execute``: per call, (decode rows, chunks, rows that chose a token, host waits,
    waiting operators and host reads found)."""
    calls = []
    execute = engine.execute

    def watched(plan):
        before = transfers.host_waits
        with WaitingOps() as ops, ops.host_reads():
            result = execute(plan)
        calls.append((len(plan.decode), len(plan.chunks), len(result.sampled), transfers.host_waits - before, ops.found))
        return result

    engine.execute = watched
    return calls


@pytest.fixture(params=["eager", "step graphs"])
def core(request, tiny_torch_artifact):
    model = TextGenerationModel(tiny_torch_artifact)
    core = model.core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=8))
    if request.param == "step graphs":  # the CUDA graphs' buckets, replayed eagerly on the CPU
        core.engine.graphs = StepGraphs(core.engine, 8)
        core.engine.graphs.capture()
    return core


def test_a_step_waits_on_the_device_once(core):
    """Greedy and sampled rows (one with penalties, one under a grammar mask), prompts of 3 to 20
    tokens prefilled in chunks of 8 beside decode rows: every call that chooses tokens waits once,
    a call that only prefills never, and no implicitly waiting operator runs."""
    vocab = core.tokenizer.get_vocab_size(with_added_tokens=True)
    allowed = bitmask.empty(vocab)
    for token in range(3, 40):
        bitmask.allow(allowed, token)
    masked = dict(mask=allowed)
    sampled = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.95, seed=5, ignore_eos=True)
    penalised = SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, min_p=0.05, repetition_penalty=1.2,
                               frequency_penalty=0.5, seed=6, ignore_eos=True)
    requests = [Request("greedy", list(range(5, 25)), greedy(8)), Request("sampled", [7, 8, 9], sampled),
                Request("penalised", list(range(30, 42)), penalised), Request("masked", [11, 12, 13, 14], greedy(6)),
                Request("late", list(range(50, 60)), greedy(5))]
    calls = watched_steps(core.engine)
    core.engine.execute = with_mask(core.engine.execute, "masked", masked["mask"])
    outputs = list(run_to_completion(core, requests))
    assert not [o for o in outputs if o.error is not None]
    assert {o.request_id for o in outputs} == {r.request_id for r in requests}
    steps = [c for c in calls if c[0] or c[1]]
    assert any(decode and chunks for decode, chunks, *_ in steps), "no mixed step ran"
    for decode, chunks, chose, waits, found in steps:
        assert waits == (1 if chose else 0), (decode, chunks, chose, waits)
        assert found == [], found


def with_mask(execute, seq, mask):
    """Hands the engine a grammar mask for ``seq`` whenever it chooses a token for it."""
    def run(plan):
        if plan.masks is None and (seq in plan.decode or any(c.seq == seq and c.last for c in plan.chunks)):
            plan.masks = lambda: {seq: mask}
        return execute(plan)
    return run


def test_rows_that_want_logits_on_the_host_wait_again(core):
    """Log-probabilities come to the host from the logits: a step with such a row waits more than
    once (the tokens, then the row's log-probabilities), by design."""
    calls = watched_steps(core.engine)
    params = SamplingParams(max_new_tokens=3, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    outputs = list(run_to_completion(core, [Request("r", [5, 6, 7], params)]))
    assert all(o.delta.top_logprobs and len(o.delta.top_logprobs) == 2 for o in outputs)
    assert [waits for _, _, chose, waits, _ in calls if chose] == [4, 4, 4]  # tokens, chosen, top values, top ids
    assert all(found == [] for *_, found in calls)


def test_the_counted_copy_is_the_tokens(core, monkeypatch):
    """What comes back is what the step chose: the tokens and a status word a row, in one array."""
    copies = []
    result = transfers.HostCopy.result
    monkeypatch.setattr(transfers.HostCopy, "result", lambda copy: copies.append(result(copy)) or copies[-1])
    outputs = list(run_to_completion(core, [Request("g", [5, 6, 7], greedy(3))]))
    assert [c.shape for c in copies] == [(2, 1)] * 3
    assert [int(c[0, 0]) for c in copies] == [o.delta.token_id for o in outputs]
    assert not np.any(np.stack(copies)[:, 1])  # no row's status flagged
