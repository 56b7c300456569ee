"""The batcher's own rules, without a model: padding limit, sharing, and when a batch runs alone."""

from __future__ import annotations

import asyncio
import time

from modelkiln.serve.batcher import ALONE_BELOW, Batcher, BatchHooks, Item, Job


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
