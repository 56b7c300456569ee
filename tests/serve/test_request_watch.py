"""RequestWatch: one ticker cancels requests whose body stalls or whose client left."""

from __future__ import annotations

import asyncio
import time

import pytest

from modelkiln.serve.http.request_watch import RequestWatch


class Cycle:
    """Stands in for uvicorn's request object: ``disconnected`` is what the watch looks at."""

    def __init__(self) -> None:
        self.disconnected = False

    async def receive(self) -> dict:
        await asyncio.sleep(3600)  # a body that never comes
        return {}


def test_a_stalled_body_is_cancelled_after_the_timeout():
    async def scenario() -> tuple[str, float]:
        watch = RequestWatch(body_timeout_s=0.3, tick_s=0.05)
        cycle = Cycle()
        w = watch.enter(cycle.receive)
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await cycle.receive()
        asyncio.current_task().uncancel()
        return w.why, time.monotonic() - started

    why, waited = asyncio.run(scenario())
    assert why == "body" and 0.3 <= waited < 1.0


@pytest.mark.parametrize("server_object", [True, False], ids=["uvicorn", "other-server"])
def test_a_request_whose_client_left_is_cancelled(server_object):
    async def scenario() -> str:
        watch = RequestWatch(body_timeout_s=10, tick_s=0.05)
        cycle = Cycle()
        gone = asyncio.Event()

        async def receive() -> dict:  # another server: only receive() tells
            await gone.wait()
            return {"type": "http.disconnect"}

        recv = cycle.receive if server_object else receive
        w = watch.enter(recv)
        watch.body_read(w, recv)
        kept = watch.enter(recv)  # another request on the same server, still wanted
        watch.body_read(kept, recv)
        watch.answering(kept)

        async def hang_up() -> None:
            await asyncio.sleep(0.1)
            cycle.disconnected = True
            gone.set()

        asyncio.get_running_loop().create_task(hang_up())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)  # waiting for the answer
        asyncio.current_task().uncancel()
        assert kept.why == ""
        return w.why

    assert asyncio.run(scenario()) == "gone"
