"""The batcher's own rules, without a model: padding limit, sharing, and when a batch runs alone."""

from __future__ import annotations

import asyncio
import time

from modelkiln.serve.batcher import ALONE_BELOW, Batcher, BatchHooks, Item, Job, wait_for


class FakeModel(BatchHooks):
    """Token length = len(text); execute sleeps a little and records what it was given."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.batches: list[tuple[list[int], bool]] = []

    def tokenize(self, items):
        for it in items:
            it.length = len(it.text)
        return [None] * len(items)

    def execute(self, batch, instance=0, alone=False):
        self.batches.append(([it.length for it in batch], alone))
        time.sleep(self.seconds)
        return [it.text for it in batch]


def items_of_lengths(lengths: list[int]) -> list[Item]:
    out = []
    for n in lengths:
        job = Job(n=1, future=None)  # type: ignore[arg-type]
        item = Item(job, 0, "x" * n)
        item.length = n
        out.append(item)
    return out


def test_padding_limit_keeps_far_lengths_out_of_the_oldest_inputs_batch():
    items = items_of_lengths([10, 11, 30, 31])  # the 10-token input is the oldest
    limited = Batcher(FakeModel(), max_batch_size=32, max_batch_tokens=8192, max_queue_size=64, max_padding=0.15)
    batch, rest = limited._select(list(items))
    assert sorted(it.length for it in batch) == [10, 11] and sorted(it.length for it in rest) == [30, 31]

    unlimited = Batcher(FakeModel(), max_batch_size=32, max_batch_tokens=8192, max_queue_size=64)
    batch, rest = unlimited._select(list(items))
    assert len(batch) == 4 and not rest
    token_bound = Batcher(FakeModel(), max_batch_size=32, max_batch_tokens=62, max_queue_size=64)
    batch, _ = token_bound._select(list(items))
    assert len(batch) * max(it.length for it in batch) <= 62


def test_lone_requests_run_alone_and_a_burst_does_not():
    model = FakeModel(seconds=0.005)
    batcher = Batcher(model, max_batch_size=4, max_batch_tokens=8192, max_queue_size=256, instances=2)
    batcher.start()

    async def one(text: str) -> list:
        job = Job(n=1, future=asyncio.get_running_loop().create_future())
        batcher.submit([Item(job, 0, text)])
        return await job.future

    async def scenario() -> None:
        for k in range(5):  # one client at a time
            assert await one("a" * (k + 1)) == ["a" * (k + 1)]
        assert all(alone for _, alone in model.batches)
        model.batches.clear()
        texts = [f"text {k}" for k in range(40)]  # forty clients at once, answers in their own order
        assert await asyncio.gather(*(one(t) for t in texts)) == [[t] for t in texts]
        assert batcher._load > ALONE_BELOW
        assert not any(alone for _, alone in model.batches[1:])  # the very first may have found it idle
        model.batches.clear()
        await one("after the burst")  # the load average has not decayed yet: not alone
        assert model.batches == [([len("after the burst")], False)]
        for _ in range(60):  # the average decays by 0.9 per arrival
            await one("quiet again")
        assert model.batches[-1][1] is True

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop(5)


def test_work_wakes_the_most_recently_idle_instance():
    """One client at a time: the thread that answered the last request takes the next one (its
    caches are warm), instead of the idle instances taking turns."""
    instances_used: list[int] = []

    class Recorder(FakeModel):
        def execute(self, batch, instance=0, alone=False):
            instances_used.append(instance)
            return super().execute(batch, instance, alone)

    batcher = Batcher(Recorder(), max_batch_size=4, max_batch_tokens=8192, max_queue_size=16, instances=3)
    batcher.start()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for k in range(8):
            deadline = time.monotonic() + 5
            while len(batcher._idle) < 3:  # every thread back waiting: the order is then the test's subject
                assert time.monotonic() < deadline, "engine threads did not go idle"
                await asyncio.sleep(0.001)
            job = Job(n=1, future=loop.create_future())
            batcher.submit([Item(job, 0, f"request {k}")])
            assert await job.future == [f"request {k}"]

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop(5)
    assert len(instances_used) == 8 and len(set(instances_used[1:])) == 1, instances_used


class Recording(FakeModel):
    """Records the texts of every batch it runs; a text "poison" makes the whole batch fail, as
    an input onnxruntime cannot run fails every row of its batch."""

    def __init__(self, seconds: float = 0.0):
        super().__init__(seconds)
        self.texts: list[list[str]] = []

    def execute(self, batch, instance=0, alone=False):
        self.texts.append([it.text for it in batch])
        if any(it.text == "poison" for it in batch):
            raise ValueError("the engine cannot run this batch")
        return super().execute(batch, instance, alone)


def test_a_failing_request_does_not_fail_its_batch_neighbours():
    model = Recording(seconds=0.05)
    batcher = Batcher(model, max_batch_size=8, max_batch_tokens=8192, max_queue_size=64, instances=1)
    batcher.start()

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        jobs = {t: Job(n=1, future=loop.create_future()) for t in ("busy", "good", "poison", "also")}
        batcher.submit([Item(jobs["busy"], 0, "busy")])  # holds the engine while the rest queue up
        await asyncio.sleep(0.01)
        for text in ("good", "poison", "also"):
            batcher.submit([Item(jobs[text], 0, text)])
        return await asyncio.gather(*(j.future for j in jobs.values()), return_exceptions=True)

    try:
        busy, good, poison, also = asyncio.run(scenario())
    finally:
        batcher.stop(5)
    assert (busy, good, also) == (["busy"], ["good"], ["also"])
    assert isinstance(poison, ValueError)
    assert sorted(model.texts[1]) == ["also", "good", "poison"]  # they were batched together, then split


def test_requests_whose_client_is_gone_are_dropped_before_they_run():
    """A handler cancelled while its request waits in the queue (the client disconnected):
    the batcher skips the request's inputs instead of computing answers nobody reads."""
    model = Recording(seconds=0.1)
    batcher = Batcher(model, max_batch_size=4, max_batch_tokens=8192, max_queue_size=64, instances=1)
    batcher.start()

    async def one(text: str, n: int = 1) -> list:
        job = Job(n=n, future=asyncio.get_running_loop().create_future())
        batcher.submit([Item(job, i, f"{text}{i}") for i in range(n)])
        return await wait_for(job, 10, lambda: TimeoutError())

    async def scenario() -> None:
        busy = asyncio.ensure_future(one("busy"))
        await asyncio.sleep(0.02)  # the engine is running "busy" now
        gone = asyncio.ensure_future(one("gone", n=6))
        kept = asyncio.ensure_future(one("kept"))
        await asyncio.sleep(0.01)
        gone.cancel()  # what a disconnect does to the request's handler
        assert await kept == ["kept0"] and await busy == ["busy0"]
        assert gone.cancelled()

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop(5)
    ran = [t for batch in model.texts for t in batch]
    assert "kept0" in ran and not [t for t in ran if t.startswith("gone")], model.texts
    assert batcher.queued == 0
