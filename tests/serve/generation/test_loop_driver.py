"""The engine core behind ``kiln serve``'s scheduler thread, in process (no HTTP): chunked prefill
interleaved with running streams, the KV budget's admission rule, the running-rows bound,
cancellation and timeouts, on the tiny fp32 Llama."""

from __future__ import annotations

import asyncio
import time

import pytest

from modelkiln.errors import InvalidInputError, OverloadedError, RequestTimeoutError
from modelkiln.generation.core import CoreHooks, EngineCore, Request
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.sampling import SamplingParams
from modelkiln.serve.generation.loop_driver import Job, LoopDriver

_ids = iter(range(1, 1 << 30))


class Recorder(CoreHooks):
    def __init__(self) -> None:
        self.iterations: list[tuple[int, int, int]] = []

    def iteration(self, running: int, waiting: int, cache_tokens: int) -> None:
        self.iterations.append((running, waiting, cache_tokens))


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


def make(tiny, **kw) -> tuple[LoopDriver, Recorder]:
    hooks = Recorder()
    options = dict(max_running=8, max_waiting=8, kv_budget=100_000, prefill_chunk=16)
    options.update(kw)
    engine = tiny.engine("fp32", EngineOptions(threads=1, max_rows=options["max_running"]))
    scheduler = LoopDriver(EngineCore(engine, tiny.tokenizer, tiny.eos_ids, hooks=hooks, **options))
    scheduler.start()
    return scheduler, hooks


def job(prompt: list[int], n: int, timeout: float = 60.0) -> Job:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return Job(next(_ids), prompt, params, deadline=time.monotonic() + timeout, loop=asyncio.get_running_loop(),
               queue=asyncio.Queue())


async def collect(j: Job) -> list:
    events = []
    while True:
        event = await j.queue.get()
        events.append(event)
        if isinstance(event, Exception) or event.finish_reason:
            return events


def test_long_prompt_is_prefilled_in_chunks_while_a_stream_runs(tiny):
    """A 200-token prompt (13 chunks of 16) arrives while a stream runs: the stream keeps getting a
    token every iteration, and both answers equal their lone runs."""
    prompt = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20).ids[:200]
    short = tiny.tokenizer.encode("Hello").ids

    async def run(together: bool) -> tuple[list[int], list[int], list[int]]:
        scheduler, hooks = make(tiny)
        try:
            a = job(short, 400)  # long enough to still run when b arrives, however slow the machine
            scheduler.submit(a)
            first = await a.queue.get()
            b = job(prompt, 5)
            scheduler.submit(b) if together else None
            rest_a = await collect(a)
            if not together:
                scheduler.submit(b)
            events_b = await collect(b)
        finally:
            scheduler.stop(10)
        steps_with_both = [it for it in hooks.iterations if it[0] == 2]
        return ([e.token_id for e in [first, *rest_a]], [e.token_id for e in events_b],
                [len(steps_with_both)])

    alone_a, alone_b, _ = asyncio.run(run(False))
    together_a, together_b, (overlap,) = asyncio.run(run(True))
    assert together_a == alone_a and together_b == alone_b
    assert overlap >= 200 // 16  # the long prompt took one chunk per iteration, next to the running stream


def test_kv_budget_admits_what_fits_and_refuses_what_never_can(tiny):
    """The budget is the sum of each sequence's reserve (prompt + max new tokens): the serving
    engine's cache holds each sequence's own length."""
    async def run() -> None:
        # each job may reach 10 + 20 = 30 tokens: two fit in 64, a third waits for one to leave
        scheduler, hooks = make(tiny, kv_budget=64)
        try:
            jobs = [job(list(range(1, 11)), 20) for _ in range(3)]
            for j in jobs:
                scheduler.submit(j)
            results = await asyncio.gather(*[collect(j) for j in jobs])
            assert all(len(r) == 20 and r[-1].finish_reason == "length" for r in results)
            assert max(running for running, _, _ in hooks.iterations) == 2
            assert max(tokens for _, _, tokens in hooks.iterations) <= 64
            with pytest.raises(InvalidInputError, match="KV cache"):
                scheduler.submit(job(list(range(1, 11)), 60))
        finally:
            scheduler.stop(10)

    asyncio.run(run())


def test_queue_bound_cancel_and_timeout(tiny):
    async def run() -> None:
        scheduler, hooks = make(tiny, max_running=1, max_waiting=1)
        try:
            running, waiting = job([1, 2, 3], 1000 - 4), job([1, 2, 3], 5)
            scheduler.submit(running)
            await running.queue.get()
            scheduler.submit(waiting)
            with pytest.raises(OverloadedError):
                scheduler.submit(job([1, 2], 2))
            scheduler.cancel(running)  # its client left: the waiting one gets the slot
            assert len(await collect(waiting)) == 5
            assert running.state is not None and len(running.state.generated_ids) < 1000 - 4
            await asyncio.sleep(0.05)
            assert scheduler.running == 0 and scheduler.engine.cache_tokens == 0
            slow = job([1, 2, 3], 1000 - 4, timeout=0.05)  # runs out of time mid-answer
            scheduler.submit(slow)
            events = await collect(slow)
            assert isinstance(events[-1], RequestTimeoutError) and len(events) < 1000 - 4
            await asyncio.sleep(0.1)
            assert scheduler.running == 0 and scheduler.engine.cache_tokens == 0
        finally:
            scheduler.stop(10)

    asyncio.run(run())


def test_running_rows_never_exceed_max_running(tiny):
    """Ten requests at once with room for three: never more than three run, all finish."""
    async def run() -> None:
        scheduler, hooks = make(tiny, max_running=3, max_waiting=16)
        try:
            jobs = [job([1, 2, 3 + i], 6) for i in range(10)]
            for j in jobs:
                scheduler.submit(j)
            results = await asyncio.gather(*[collect(j) for j in jobs])
            assert all(len(r) == 6 for r in results)
            assert max(running for running, _, _ in hooks.iterations) == 3
        finally:
            scheduler.stop(10)

    asyncio.run(run())


def test_an_engine_failure_fails_the_active_requests_and_the_next_ones_are_served(tiny):
    """A step that raises ends what was running with an error; the core goes on with later requests."""
    async def run() -> None:
        scheduler, _ = make(tiny)
        engine = scheduler.engine
        real_step = engine.step
        try:
            engine.step = lambda tokens: (_ for _ in ()).throw(RuntimeError("kernel failed"))
            failing = job([1, 2, 3], 5)
            scheduler.submit(failing)
            events = await collect(failing)
            assert isinstance(events[-1], Exception) and "kernel failed" in str(events[-1])
            engine.step = real_step
            later = job([1, 2, 3], 5)
            scheduler.submit(later)
            assert len(await collect(later)) == 5 and scheduler.running == 0
        finally:
            engine.step = real_step
            scheduler.stop(10)

    asyncio.run(run())


def _unchecked(params: SamplingParams, **values) -> SamplingParams:
    """``params`` with values its own checks refuse: what a gap in the protocol edge's checks would let in."""
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


def test_a_request_whose_own_settings_fail_ends_alone(tiny):
    """A request whose sampler cannot be built (a negative seed) or cannot choose (NaN temperature)
    ends with its own error; the stream beside it goes on to its last token. Before, the core failed
    every active request and lost the bad one (its client waited until the timeout)."""
    async def run() -> None:
        scheduler, _ = make(tiny)
        try:
            good = job([1, 2, 3], 300)
            scheduler.submit(good)
            await good.queue.get()
            bad_seed, bad_temperature = job([4, 5, 6], 5), job([7, 8, 9], 5)
            _unchecked(bad_seed.params, seed=-1, temperature=1.0)
            _unchecked(bad_temperature.params, temperature=float("nan"))
            scheduler.submit(bad_seed)
            scheduler.submit(bad_temperature)
            for bad in (bad_seed, bad_temperature):
                events = await asyncio.wait_for(collect(bad), 10)
                assert len(events) == 1 and isinstance(events[0], Exception)
            rest = await collect(good)
            assert len(rest) == 299 and rest[-1].finish_reason == "length"
        finally:
            scheduler.stop(10)

    asyncio.run(run())


def test_a_hang_up_mid_prefill_frees_the_sequence_at_the_next_step(tiny):
    """The core stepped by hand: a 300-token prompt, chunks of 16; after its first chunk the client
    leaves; the next step frees its cache without computing another chunk or a token."""
    engine = tiny.engine("fp32", EngineOptions(threads=1))
    core = EngineCore(engine, tiny.tokenizer, tiny.eos_ids, prefill_chunk=16)
    prompt = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20).ids[:300]
    core.add_request(Request("long", prompt, SamplingParams(max_new_tokens=4)))
    assert core.step() == [] and core.running == 1 and engine.cache_tokens == 16  # one chunk in, no token yet
    core.abort("long")
    assert core.step() == [] and core.running == 0 and engine.cache_tokens == 0 and "long" not in engine
    assert not core.has_work()
