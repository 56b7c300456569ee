"""kiln loadtest against a real `kiln serve` process (tiny random models, short windows): the counts
the client reports equal the server's own request counters, errors are counted by status, and
the CLI writes CSV / JSON / a PNG plot."""

from __future__ import annotations

import csv
import json
import re

import httpx
import pytest
from helpers import kiln

from modelkiln.loadtest.api import LoadtestOptions, run_loadtest
from modelkiln.loadtest.report import read_json
from modelkiln.loadtest.runner import Load

SHORT = dict(warmup_s=0.2, window_s=0.3, stable_windows=2, max_windows=2)


@pytest.fixture(scope="module")
def server(encoder_server):
    return encoder_server  # conftest.py: one encoder server for both loadtest modules


def server_count(url: str, model: str, route: str, status: str) -> int:
    """kiln_requests_total for one label set, read with a plain regex (not the code under test)."""
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'kiln_requests_total{{model="{model}",protocol="http",route="{route}",status="{status}"}} ([0-9.e+]+)', text)
    return int(float(m.group(1))) if m else 0


def test_closed_loop_counts_equal_server_counters(server):
    before = server_count(server.url, "cls", "infer", "200")
    opts = LoadtestOptions(url=server.url, model="cls", loads=(Load("concurrency", 1), Load("concurrency", 4)), **SHORT)
    result = run_loadtest(opts)
    after = server_count(server.url, "cls", "infer", "200")
    assert [s.value for s in result.steps] == [1, 4]
    for step in result.steps:
        assert step.errors == {} and step.requests > 0 and step.throughput > 0
        assert step.latency is not None and 0 < step.latency.p50 <= step.latency.p90 <= step.latency.p99 <= step.latency.max
        assert step.sent == sum(step.answered.values())
        # the server's own counter for this step (scraped while idle, before and after) agrees exactly
        assert step.server_total is not None and step.server_total.by_status == step.answered
        assert step.server is not None and step.server.batch_size is not None and step.server.batch_size >= 1
        assert step.server.queue_ms is not None and step.server.compute_ms is not None
    # and so does a plain read of /metrics around the whole run
    assert after - before == sum(s.answered["200"] for s in result.steps)


def test_open_loop_binary_qa(server):
    before = server_count(server.url, "qa", "infer", "200")
    opts = LoadtestOptions(url=server.url, model="qa", loads=(Load("rate", 100),), protocol="oip-binary", **SHORT)
    step = run_loadtest(opts).steps[0]
    assert step.errors == {} and step.late_fraction is not None
    assert 30 < step.throughput < 200  # Poisson arrivals at 100/s over 0.6 s: loose bounds
    assert server_count(server.url, "qa", "infer", "200") - before == step.answered["200"] == step.sent


def test_errors_counted_by_status(server):
    # 16 inputs per request with the server's limit at 8: every request is a 400
    opts = LoadtestOptions(url=server.url, model="cls", loads=(Load("concurrency", 2),), protocol="task", batch=16,
                           **SHORT)
    step = run_loadtest(opts).steps[0]
    assert step.requests == 0 and step.latency is None and set(step.errors) == {"400"}
    assert step.server_total is not None and step.server_total.by_status == step.answered == {"400": step.sent}


def test_cli_writes_csv_json_plot(server, tmp_path):
    first = tmp_path / "first.json"
    r = kiln("loadtest", server.url, "--model", "cls", "--protocol", "task", "--batch", "2", "--inputs", "sts",
             "--length", "short", "--concurrency", "1:2:x2", "--warmup", "0.2", "--window", "0.3", "--max-windows", "2",
             "--json", str(first), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "c=1" in r.stdout and "c=2" in r.stdout
    csv_path, png = tmp_path / "second.csv", tmp_path / "plot.png"
    r = kiln("loadtest", server.url, "--model", "cls", "--rate", "50", "--warmup", "0.2", "--window", "0.3",
             "--max-windows", "2", "--csv", str(csv_path), "--plot", str(png), "--compare", str(first), timeout=120)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 1 and rows[0]["mode"] == "rate" and float(rows[0]["throughput"]) > 0
    earlier = read_json(first)
    assert earlier.protocol == "task" and earlier.batch == 2 and len(earlier.steps) == 2
    assert earlier.steps[0].inputs_per_s == pytest.approx(2 * earlier.steps[0].throughput)
    assert json.loads(first.read_text())["steps"][0]["server_total"]["kind"] == "kiln"
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_cli_errors(server, tmp_path):
    r = kiln("loadtest", server.url, "--model", "nope", "--concurrency", "1", "--warmup", "0.1", "--window", "0.1",
             "--max-windows", "1", timeout=60)
    assert r.returncode == 0  # the run happens; every request is a 404 and the table says so
    assert "404" in r.stdout
    r = kiln("loadtest", server.url, "--model", "cls", "--concurrency", "1", "--rate", "5", timeout=60)
    assert r.returncode == 2 and "not both" in r.stderr


# --- a server that closes kept-alive connections ------------------------------------------------

def test_a_kept_alive_connection_the_server_closed_is_sent_again():
    """A server may close an idle kept-alive connection (llama-server does after every streamed
    answer) while the client is already sending the next request on it. No byte of an answer came,
    so it is no failure of the server: both the closed loop and the open loop's sender send the
    request again on a new connection, counted once (the generation client does the same)."""
    import asyncio

    from modelkiln.loadtest.generators import ClosedLoop, send_one
    from modelkiln.loadtest.records import StepState

    body = b'{"ok": true}'
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    served = []

    async def answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(answer)
        await writer.drain()
        served.append(1)
        await asyncio.sleep(0.05)  # the client has its answer and sends the next request on this connection
        writer.close()

    request = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"

    async def main() -> tuple[StepState, StepState]:
        server = await asyncio.start_server(answer_once_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        opened = StepState([request], rate=None, seed=0)
        conn = None
        for _ in range(4):
            conn = await send_one(opened, conn, "127.0.0.1", port, timeout=5)
        closed = StepState([request], rate=None, seed=0)
        client = ClosedLoop(closed, "127.0.0.1", port, timeout=5)
        task = asyncio.create_task(client.run())
        while len(closed.codes) < 4:
            await asyncio.sleep(0.01)
        closed.stop = True
        await asyncio.wait_for(task, 5)
        server.close()
        return opened, closed

    opened, closed = asyncio.run(main())
    assert opened.codes == [200] * 4 and opened.sent == 4
    assert set(closed.codes) == {200} and closed.sent == len(closed.codes), (closed.codes, closed.sent)
    assert len(served) == 4 + len(closed.codes)
