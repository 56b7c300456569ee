"""Can ``kiln serve``'s HTTP front keep up with its engine? Output tokens a second at N streams, in process
(the engine core stepped directly) and over HTTP (OpenAI ``/v1/completions`` with ``stream: true``, one SSE
event a token, read by ``wrk``), with an engine whose steps cost the host what they cost it on a GPU.

The engine is the torch engine of a tiny random Llama with SmolLM2's tokenizer (49,152 tokens, so each
token's text costs what it does on a real vocabulary), its forward pass replaced by one that returns
preallocated logits and its choice of tokens by one that hands out the tokens of a real sentence in turn
(no [rows, vocab] work on this CPU: on a GPU that is the device's). What is left is the host's work per
step (planning, bookkeeping, detokenizing, delivering: ``host_step.py`` measures it by phase) and, over
HTTP, the front's: one event loop that writes every stream's events. The ratio HTTP / in process says
whether one event loop keeps up with an engine this fast; on a GPU the engine's host work is the same
kind and the goal is 0.8 at 256 streams.

    python benchmarks/generation/sse_front.py --tokenizer /work/art/smollm2 [--streams 16 256] [--workers 1 2]

The server is ``kiln serve`` in child processes (the idle engine patched in by a ``sitecustomize`` on
their path), its engine on one torch thread: ``--workers 1`` one process, ``--workers N`` an engine
process and N front processes; ``wrk`` (one thread, one connection a stream) in another. Each figure
is tokens received in complete answers over the run's seconds; "server CPU" counts every process of it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

SENTENCE = ("The quick brown fox jumps over the lazy dog, and then it runs back across the field to the river "
            "where the water is cold and clear in the morning light.")
WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
"""


def tiny_artifact(tokenizer_folder: Path, work: Path) -> Path:
    """A random 2-layer Llama with the tokenizer's vocabulary, converted by ``kiln convert --engine torch``."""
    import torch
    import transformers as tf

    from modelkiln.convert.pipeline import ConvertConfig, convert

    hf = work / "hf"
    hf.mkdir()
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_folder / "tokenizer.json"), eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.save_pretrained(hf)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id)
    tf.LlamaForCausalLM(config).eval().save_pretrained(hf)
    out = work / "artifact"
    convert(ConvertConfig(model=str(hf), out=out, task="text-generation", engine="torch", precisions=["fp32"],
                          threads=1, timing_seconds=0.02))
    return out


def idle_engine(tokenizer_json: Path) -> None:
    """Every torch engine made after this: forward passes and choices of tokens that cost the host
    nothing beyond their calls (``SENTENCE``'s tokens handed out in turn)."""
    import torch
    from tokenizers import Tokenizer

    from modelkiln.generation.engines.torch.decoder import TorchDecoder
    from modelkiln.generation.sampling.device import DeviceSampler

    tokens = Tokenizer.from_file(str(tokenizer_json)).encode(SENTENCE).ids
    cycle = torch.tensor(tokens * (1 + 4096 // len(tokens)))
    logits: dict[int, torch.Tensor] = {}
    turn = [0]

    def forward(self, step, cache) -> torch.Tensor:
        wanted = step.select.shape[0] if step.select is not None else step.ids.shape[0]
        vocab = self.config.vocab
        if vocab not in logits:
            logits[vocab] = torch.zeros(4096, vocab)
        return logits[vocab][:wanted]

    def chosen(rows: int) -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(tokens)
        picked = cycle[turn[0]:turn[0] + rows]
        return torch.stack([picked, torch.zeros_like(picked)])

    TorchDecoder.forward = forward  # type: ignore[method-assign]
    DeviceSampler.choice = lambda self, slots, logits, masks: chosen(len(slots))  # type: ignore[method-assign]
    DeviceSampler.graph_choice = lambda self, index, logits, draws: chosen(index.shape[0])  # type: ignore


def in_process(artifact: Path, streams: int, tokens: int, seconds: float) -> float:
    """Output tokens a second of the engine core alone, ``streams`` answers of ``tokens`` at a time."""
    from modelkiln.generation.core import Request, greedy
    from modelkiln.generation.model import CoreOptions, TextGenerationModel

    core = TextGenerationModel(artifact).core(None, CoreOptions(threads=1, max_running=streams, warm_up=True))
    prompt = core.tokenizer.encode("Tell me a story.").ids
    made, count, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        while core.running + core.waiting < streams:
            core.add_request(Request(made, prompt, greedy(tokens)))
            made += 1
        for output in core.step():
            count += output.delta is not None
    return count / (time.perf_counter() - started)


def over_http(artifact: Path, tokenizer_json: Path, streams: int, tokens: int, seconds: float,
              workers: int) -> tuple[float, str]:
    """Output tokens a second received by ``wrk`` over SSE from ``kiln serve --workers N``, and the
    server's CPU use (every process of it)."""
    from modelkiln.net import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as patch:
        # every process of the server (the engine process too) starts with the idle engine
        Path(patch, "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"from sse_front import idle_engine\nidle_engine({str(tokenizer_json)!r})\n")
        env = {**os.environ, "KILN_THREADS": "1", "KILN_PORT": str(port), "KILN_LOG_LEVEL": "warning",
               "PYTHONPATH": os.pathsep.join([patch, str(SRC)])}
        server = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", f"tiny={artifact}", "--device", "cpu",
                                   "--max-batch-size", str(streams), "--workers", str(workers)],
                                  env=env, stderr=subprocess.PIPE, text=True)
        try:
            wait_ready(port, server)
            body = json.dumps({"model": "tiny", "prompt": "Tell me a story.", "max_tokens": tokens, "stream": True,
                               "ignore_eos": True, "temperature": 0})
            script = Path(patch, "post.lua")
            script.write_text(WRK_SCRIPT.format(body=body))
            url = f"http://127.0.0.1:{port}/v1/completions"
            subprocess.run(["wrk", "-t1", f"-c{streams}", "-d2s", "-s", str(script), url], capture_output=True, check=True)
            cpu_before = _cpu_seconds(server.pid)
            run = subprocess.run(["wrk", "-t1", f"-c{streams}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script),
                                  url], capture_output=True, text=True, check=True)
            cpu = (_cpu_seconds(server.pid) - cpu_before) / seconds
            done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", run.stdout)
            if done is None or "Non-2xx" in run.stdout:
                raise RuntimeError(run.stdout)
            took = float(done.group(2)) / (1000 if done.group(3) == "ms" else 1)
            return int(done.group(1)) * tokens / took, f"server CPU {cpu:.2f} cores"
        finally:
            server.terminate()
            server.wait(60)


def python_sse_load(url: str, body: dict, streams: int, seconds: float, processes: int) -> float:
    """Output tokens a second that ``streams`` clients, each asking ``body`` (streamed) again as soon
    as its answer is whole, receive over ``seconds``: the tokens of complete answers (their usage
    chunk), counted in ``processes`` client processes (asyncio and httpx; for a machine without ``wrk``)."""
    import multiprocessing

    shares = [streams // processes + (i < streams % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        counts = pool.starmap(_client_process, [(url, body, share, seconds) for share in shares if share])
    return sum(counts) / seconds


def _client_process(url: str, body: dict, streams: int, seconds: float) -> int:
    import asyncio

    import httpx

    async def client(http: httpx.AsyncClient, deadline: float) -> int:
        tokens = 0
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        while time.monotonic() < deadline:
            answered = 0  # the answer's tokens, from its usage chunk (a token whose text is held adds no event)
            async with http.stream("POST", url, json=request) as answer:
                if answer.status_code != 200:
                    raise RuntimeError(f"{answer.status_code}: {(await answer.aread())[:500]!r}")
                async for line in answer.aiter_lines():
                    if line.startswith('data: {"') and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        answered = usage.get("completion_tokens", answered)
            if time.monotonic() <= deadline:
                tokens += answered
        return tokens

    async def run() -> int:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            deadline = time.monotonic() + seconds
            return sum(await asyncio.gather(*(client(http, deadline) for _ in range(streams))))

    return asyncio.run(run())


def wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 120) -> None:
    """Returns once the ``kiln serve`` process ``server`` answers ready on ``port``; RuntimeError if it
    exits first (with its stderr's tail) or takes longer than ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {server.stderr.read()[-2000:] if server.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not ready")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its descendants (running ones, and those it waited for)."""
    total = 0.0
    for child in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir() if Path(f"/proc/{pid}/task").exists() else []:
        children = Path(task, "children")
        for child in children.read_text().split() if children.exists() else []:
            found += [int(child), *_descendants(int(child))]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=Path("/work/art/smollm2"), help="a folder with tokenizer.json")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="kiln serve --workers: 1 is one process; N > 1 an engine process and N fronts")
    args = parser.parse_args()
    from modelkiln.machine import cpu_description

    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} ({cpu['isa']}, {cpu['cores']} cores); server: 1 torch thread; wrk: 1 thread")
    print(f"answers of {args.tokens} tokens, one SSE event a token; {args.seconds:g} s a run; output tokens/s")
    with tempfile.TemporaryDirectory() as folder:
        artifact = tiny_artifact(args.tokenizer, Path(folder))
        idle_engine(args.tokenizer / "tokenizer.json")
        print(f"{'streams':>7} {'round':>5} {'in process':>11} {'workers':>7} {'HTTP SSE':>9} {'ratio':>6}  server")
        for streams in args.streams:
            for round_ in range(args.rounds):
                alone = in_process(artifact, streams, args.tokens, args.seconds)
                for workers in args.workers:
                    served, cpu_use = over_http(artifact, args.tokenizer / "tokenizer.json", streams, args.tokens,
                                                args.seconds, workers)
                    print(f"{streams:>7} {round_ + 1:>5} {alone:>11,.0f} {workers:>7} {served:>9,.0f} "
                          f"{served / alone:>6.2f}  {cpu_use}", flush=True)


if __name__ == "__main__":
    main()
