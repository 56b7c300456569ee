"""The host's time per torch-engine step, by phase, with a decoder whose forward does nothing: what a
GPU would wait on the host for, measured on the CPU.

The engine core runs as ``kiln serve`` runs it (``EngineCore`` over ``TorchEngine``, decode steps
through ``StepGraphs``: eager replays of the captured buckets here, CUDA graphs on a GPU), with a
tiny random Llama whose ``forward`` is replaced by one that returns preallocated logits (a few
random rows, taken in turn, so the tokens vary). The tokenizer is SmolLM2's (49,152 tokens), so
detokenization costs what it does on a real vocabulary; the logits are only ``--vocab`` wide
(default 128), because the sampler's tensor work over [rows, vocab] runs on this CPU and would be
counted as host time, where on a GPU it is the device's (asynchronous) work: what is left of it
here is the host's cost of dispatching each operation, as a GPU's launches are.

Phases (exclusive time, each a median over the steps): ``plan`` the core's scheduling (drop,
admit, plan, masks; everything outside the other phases), ``inputs`` packing the step's token ids,
positions and slots for the device, ``forward`` the replaced forward (~0), ``graph`` a decode step
graph's choice of its rows' tokens (captured with the forward pass: on a GPU the device's work, one
replay), ``sampling`` the engine's choice of tokens outside a graph and its bookkeeping (the
sampler's calls, the copy of the tokens to the host), ``update`` the engine's and the core's state
after a step, ``delivery`` turning the tokens into what the clients get (detokenization, stop
strings, result objects). ``total`` is a step's wall time in a run without the phase timers (they
cost ~1 us a call); ``host`` is ``total`` less ``graph``: what the host does in a step when the
device runs the graph. ``ops`` and ``ops ms``: the tensor operations a step runs outside the graphs'
replays (each a kernel launch on a GPU) and the time spent inside them here, measured in a third run
(a TorchDispatchMode): that time includes what the CPU computes for them, on a GPU the device's work.

    python benchmarks/generation/host_step.py [--tokenizer /work/art/smollm2] [--rows 1 256] [--graph-stand-in] [--overlap]

``--overlap`` runs the core's overlapped steps (``EngineCore(overlap=True)``): the host's work per step is
the same kind, but on a GPU it runs while the device computes the step launched before it.

``--graph-stand-in`` replaces the decode graphs' choice of tokens by one argmax: on this CPU the graph's
work runs on the host and evicts its caches, which a GPU's would not (``stand_in_graph_choice``).

Budgets: 0.25 ms a step at 1 row, 1.0 ms at 256 rows."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from modelkiln.generation import core as core_module  # noqa: E402
from modelkiln.generation.core import EngineCore, Request, greedy  # noqa: E402
from modelkiln.generation.engines.torch.engine import StepGraphs, TorchEngine, open_torch_engine  # noqa: E402
from modelkiln.generation.plan import EngineOptions, ModelShape  # noqa: E402
from modelkiln.generation.sampling import SamplingParams  # noqa: E402
from modelkiln.machine import cpu_description  # noqa: E402

PHASES = ("plan", "inputs", "forward", "graph", "sampling", "update", "delivery")
BUDGET_MS = {1: 0.25, 256: 1.0}
CONTEXT = 1024
ANSWER = 900  # tokens asked for: no answer ends while a case runs (~470 steps), none passes the context


def tiny_llama(folder: Path, vocab: int) -> Path:
    """A random 2-layer Llama with ``vocab`` tokens, its torch-fp32 weights beside its config."""
    import transformers as tf

    from modelkiln.convert.generation.torch_weights import save_weights

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=CONTEXT)).eval()
    model.config.save_pretrained(folder)
    save_weights(model, folder / "model.torch-fp32.safetensors", "fp32")
    return folder / "model.torch-fp32.safetensors"


def stand_in_graph_choice(engine: TorchEngine) -> None:
    """The decode graphs' choice of tokens replaced by one argmax (each row's best token, status 0): what
    the host sees when a GPU computes the graph, whose work then neither takes the host's time nor
    evicts the host's data from its caches (on this CPU the full choice, ~2.8 ms at 256 rows over
    [256, 128] float64, slowed the host's own phases after it by ~30%). The tokens differ from a real
    draw's; their cost to the host does not."""
    def choice(index: torch.Tensor, logits: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        return torch.stack([tokens, torch.zeros_like(tokens)])

    engine.sampler.graph_choice = choice  # type: ignore[method-assign]


def engine_with_idle_forward(weights: Path, rows: int, vocab: int) -> TorchEngine:
    engine = open_torch_engine(weights, ModelShape(4, CONTEXT), EngineOptions(threads=1, max_rows=rows))
    logits = [torch.randn(max(rows, 64), vocab) * 4 for _ in range(8)]
    turn = iter(range(1 << 62))

    def forward(step, cache) -> torch.Tensor:
        wanted = step.select.shape[0] if step.select is not None else step.ids.shape[0]
        return logits[next(turn) % len(logits)][:wanted]

    engine.decoder.forward = forward  # type: ignore[method-assign]
    engine.graphs = StepGraphs(engine, 64)  # as on CUDA: steps replay captured buckets
    engine.graphs.capture()
    return engine


class PhaseTimer:
    """Exclusive time per phase: a phase entered inside another stops the outer one's clock."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack = ["plan"]
        self._mark = time.perf_counter()

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[self._stack[-1]] += now - self._mark
        self._stack.append(phase)
        self._mark = now

    def leave(self) -> None:
        now = time.perf_counter()
        self.seconds[self._stack.pop()] += now - self._mark
        self._mark = now

    def restart(self) -> None:
        self.seconds.clear()
        self._stack = ["plan"]
        self._mark = time.perf_counter()

    def stop(self) -> None:
        self.leave()  # the outermost phase


@contextlib.contextmanager
def timed_phases(timer: PhaseTimer, targets: list[tuple[object, str, str]]) -> Iterator[None]:
    """Wrap each (owner, attribute, phase) for the duration."""
    saved = []
    for owner, name, phase in targets:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _wrapped(original, phase, timer))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _wrapped(function: Callable, phase: str, timer: PhaseTimer) -> Callable:
    def call(*args, **kwargs):
        timer.enter(phase)
        try:
            return function(*args, **kwargs)
        finally:
            timer.leave()
    return call


def phase_targets(engine: TorchEngine) -> list[tuple[object, str, str]]:
    """What each phase times. Delivery is the core's turning of a step's tokens into outputs."""
    targets: list[tuple[object, str, str]] = [
        (engine, "execute", "update"), (engine, "_run", "inputs"), (engine.decoder, "forward", "forward"),
        (engine, "_choose", "sampling"), (core_module.EngineCore, "_update", "update"),
    ]
    if hasattr(engine, "launch"):  # overlapped steps: the engine's two halves, the core's collect
        targets += [(engine, "launch", "update"), (engine, "collect", "update"),
                    (core_module.EngineCore, "_collect", "update")]
    if hasattr(engine.sampler, "graph_choice"):  # a decode step graph's choice of tokens: the graph's own work
        targets.append((engine.sampler, "graph_choice", "graph"))
    if engine.graphs is not None:
        targets.append((engine.graphs, "run", "inputs"))
    if hasattr(core_module.EngineCore, "_deliver"):
        targets.append((core_module.EngineCore, "_deliver", "delivery"))
    else:  # the core before c35cb7d delivered inside _update, a SequenceState.accept a row
        targets.append((core_module.SequenceState, "accept", "delivery"))
    return targets


class OpTimer(TorchDispatchMode):
    """Counts the tensor operations run outside the step graphs' replays (each one a launch of its own
    on a GPU, where a replay is one) and the time spent inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.seconds = 0, 0.0
        self.replaying = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.replaying:
            return func(*args, **(kwargs or {}))
        started = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.seconds += time.perf_counter() - started
            self.count += 1


@contextlib.contextmanager
def replays_uncounted(engine: TorchEngine, timer: OpTimer) -> Iterator[None]:
    """The step graphs' replays run without ``timer`` counting their operations."""
    graphs = engine.graphs
    if graphs is None:
        yield
        return
    kinds = [graphs.replays, *([graphs.sampled_replays] if hasattr(graphs, "sampled_replays") else [])]
    originals = [dict(replays) for replays in kinds]

    def uncounted(replay: Callable) -> Callable:
        def run():
            timer.replaying = True
            try:
                return replay()
            finally:
                timer.replaying = False
        return run

    for replays in kinds:
        replays.update({bucket: uncounted(replay) for bucket, replay in replays.items()})
    try:
        yield
    finally:
        for replays, original in zip(kinds, originals):
            replays.update(original)


def run_case(engine: TorchEngine, tokenizer: Tokenizer, rows: int, sampled: bool, steps: int,
             overlap: bool = False) -> dict[str, float]:
    core = EngineCore(engine, tokenizer, max_running=rows, **({"overlap": True} if overlap else {}))
    for i in range(rows):
        params = (SamplingParams(max_new_tokens=ANSWER, temperature=0.7, top_p=0.95, seed=i, ignore_eos=True)
                  if sampled else greedy(ANSWER))
        core.add_request(Request(i, [10 + i % 50, 20, 30, 40], params))
    while core.decoding < rows:
        core.step()
    for _ in range(10):  # warm
        core.step()
    took = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()
        took.append(time.perf_counter() - started)
    timer = PhaseTimer()
    per_phase: dict[str, list[float]] = defaultdict(list)
    with timed_phases(timer, phase_targets(engine)):
        for _ in range(steps):
            timer.restart()
            core.step()
            timer.stop()
            for phase in PHASES:
                per_phase[phase].append(timer.seconds.get(phase, 0.0))
    ops, op_seconds = [], []
    for _ in range(steps // 4):
        with OpTimer() as timer_ops, replays_uncounted(engine, timer_ops):
            core.step()
        ops.append(timer_ops.count)
        op_seconds.append(timer_ops.seconds)
    for i in range(rows):
        core.abort(i)
    while core.has_work():
        core.step()
    result = {phase: statistics.median(per_phase[phase]) * 1e3 for phase in PHASES}
    result["total"] = statistics.median(took) * 1e3
    result["host"] = result["total"] - result["graph"]
    result["ops"], result["ops ms"] = statistics.median(ops), statistics.median(op_seconds) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="/work/art/smollm2", help="an artifact folder with tokenizer.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--overlap", action="store_true",
                        help="overlapped steps: the core launches step N+1 before it collects step N")
    parser.add_argument("--graph-stand-in", action="store_true",
                        help="replace the decode graphs' choice of tokens by one argmax (the device's work on a GPU)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} ({cpu['isa']}, {cpu['cores']} cores); torch {torch.__version__}, 1 thread")
    if args.graph_stand_in:
        print("decode graphs' choice of tokens: a stand-in (one argmax), as the host sees a GPU's graph")
    if args.overlap:
        print("overlapped steps: each step launches the next before collecting its own (host time is what a GPU's "
              "step hides)")
    print(f"tokenizer: {args.tokenizer} ({tokenizer.get_vocab_size()} tokens); logits {args.vocab} wide; "
          f"median of {args.steps} decode steps; ms a step")
    print(f"{'rows':>5} {'sampling':<8} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'total':>9} {'host':>9} {'budget':>7}"
          f" {'ops':>5} {'ops ms':>7}")
    with tempfile.TemporaryDirectory() as folder:
        weights = tiny_llama(Path(folder), args.vocab)
        for rows in args.rows:
            engine = engine_with_idle_forward(weights, rows, args.vocab)
            if args.graph_stand_in:
                stand_in_graph_choice(engine)
            for sampled in (False, True):
                got = run_case(engine, tokenizer, rows, sampled, args.steps, args.overlap)
                budget = BUDGET_MS.get(rows)
                print(f"{rows:>5} {'top_p' if sampled else 'greedy':<8} "
                      + " ".join(f"{got[p]:>9.3f}" for p in PHASES) + f" {got['total']:>9.3f} {got['host']:>9.3f} "
                      + (f"{budget:>7.2f}" if budget else f"{'':>7}") + f" {got['ops']:>5.0f} {got['ops ms']:>7.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
