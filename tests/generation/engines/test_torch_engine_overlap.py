"""Overlapped steps (``EngineCore(overlap=True)`` over the torch engine, on the CPU): the core launches
step N+1 before it collects step N, and no answer changes for it. Mixed traffic (greedy, sampled with
top-p, penalties, stop strings, answers of every length, more requests than rows, prompts in chunks,
a resumed answer, a grammar, log-probabilities) gives the same tokens and finishes as synchronous
steps, eagerly and through the step graphs; steady decoding does overlap; a request aborted or
failing while its step is in flight loses nothing for the others and gives its row back. A row
whose best score overflows is chosen on the device as TokenChooser chooses it (no host correction
that a launched step would miss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_torch_engine_waits import WaitingOps, with_mask

from modelkiln.generation.core import Request, greedy, run_to_completion
from modelkiln.generation.engines.torch.engine import StepGraphs
from modelkiln.generation.model import CoreOptions, TextGenerationModel
from modelkiln.generation.sampling import SamplingParams, TokenChooser
from modelkiln.generation.sampling.device import DeviceSampler
from modelkiln.generation.structured_output import bitmask

RNG = np.random.default_rng(7)


def core_of(artifact, overlap: bool, graphs: bool):
    core = TextGenerationModel(artifact).core(None, CoreOptions(threads=1, max_running=4, prefill_chunk=8,
                                                                overlap=overlap))
    assert core.overlap == overlap
    if graphs:  # the CUDA graphs' buckets, replayed eagerly on the CPU
        core.engine.graphs = StepGraphs(core.engine, 8)
        core.engine.graphs.capture()
    return core


def traffic(core) -> list[Request]:
    """Eleven requests for four rows: every kind of row the core schedules differently."""
    vocab = core.tokenizer.get_vocab_size(with_added_tokens=True)
    prompts = [RNG.integers(3, vocab - 1, int(n)).tolist() for n in (5, 19, 2, 33, 9, 12, 7, 26, 3, 15, 8)]
    top_p = dict(temperature=0.9, top_p=0.9)
    settings = [greedy(12), SamplingParams(max_new_tokens=20, seed=1, ignore_eos=True, **top_p),
                SamplingParams(max_new_tokens=1, seed=2, ignore_eos=True, **top_p),
                SamplingParams(max_new_tokens=17, seed=3, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                               presence_penalty=0.2, top_k=40, temperature=1.1),
                SamplingParams(max_new_tokens=30, seed=4, stop=("e", "a"), **top_p),  # ends early on a stop string
                greedy(2), SamplingParams(max_new_tokens=25, seed=5, ignore_eos=True, min_p=0.05, temperature=0.8),
                SamplingParams(max_new_tokens=9, seed=6, ignore_eos=True, logprobs=2, **top_p),
                greedy(14), SamplingParams(max_new_tokens=11, seed=8, ignore_eos=True, **top_p),
                SamplingParams(max_new_tokens=13, seed=9, ignore_eos=True, logit_bias=((5, 3.0),), **top_p)]
    return [Request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(zip(prompts, settings))]


def answers(core, requests) -> dict:
    got: dict = {r.request_id: ([], None, []) for r in requests}
    for output in run_to_completion(core, requests):
        assert output.error is None, output.error
        tokens, _, logprobs = got[output.request_id]
        tokens.append(output.delta.token_id)
        logprobs.append(output.delta.logprob)
        got[output.request_id] = (tokens, output.delta.finish_reason, logprobs)
    return got


def watch(engine) -> list[str]:
    """Records the engine's launches and collects, in order."""
    calls: list[str] = []
    launch, collect = engine.launch, engine.collect

    def launched(plan):
        calls.append("launch")
        return launch(plan)

    def collected(step):
        calls.append("collect")
        return collect(step)

    engine.launch, engine.collect = launched, collected
    return calls


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "step graphs"])
def test_overlapped_steps_give_every_answer_the_synchronous_tokens(tiny_torch_artifact, graphs):
    overlapped, synchronous = core_of(tiny_torch_artifact, True, graphs), core_of(tiny_torch_artifact, False, graphs)
    requests = traffic(synchronous)
    expected = answers(synchronous, requests)
    calls = watch(overlapped.engine)
    got = answers(overlapped, traffic_again(requests))
    assert got == expected
    assert {r for r, (_, finish, _) in got.items() if finish == "stop"}, "no answer ended on its stop string"
    # most steps were collected with the next one already launched
    outstanding, overlapped_collects = 0, 0
    for call in calls:
        outstanding += 1 if call == "launch" else -1
        overlapped_collects += call == "collect" and outstanding >= 1
    assert overlapped_collects > calls.count("collect") // 2, calls
    assert not overlapped.has_work() and overlapped.engine.cache_tokens == 0 and len(overlapped.engine._free) == 4


def traffic_again(requests: list[Request]) -> list[Request]:
    """The same requests, fresh (a request object carries the core's state of its run)."""
    return [Request(r.request_id, list(r.prompt_ids), r.params, resume_ids=list(r.resume_ids), seed=r.seed)
            for r in requests]


def test_a_resumed_and_a_constrained_answer_are_the_same_overlapped(tiny_torch_artifact):
    """A resumed answer (its sent tokens fed through decode steps, chosen on the host) and a grammar's
    (its next mask needs the last token: synchronous steps around it) beside overlapped rows."""
    overlapped, synchronous = core_of(tiny_torch_artifact, True, True), core_of(tiny_torch_artifact, False, True)
    vocab = synchronous.tokenizer.get_vocab_size(with_added_tokens=True)
    allowed = bitmask.empty(vocab)
    for token in range(3, 60):
        bitmask.allow(allowed, token)
    prompt = RNG.integers(3, vocab - 1, 10).tolist()
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=21, ignore_eos=True)
    whole = answers(synchronous, [Request("w", prompt, sampled)])["w"][0]
    for core in (synchronous, overlapped):
        execute = core.engine.launch if core.overlap else core.engine.execute
        masked = with_mask(execute, "masked", allowed)
        if core.overlap:
            core.engine.launch = masked
        else:
            core.engine.execute = masked
    requests = [Request("resumed", prompt, sampled, resume_ids=whole[:6], seed=21),
                Request("masked", RNG.integers(3, vocab - 1, 4).tolist(), greedy(7)),
                Request("plain", RNG.integers(3, vocab - 1, 12).tolist(), greedy(15))]
    expected = answers(synchronous, requests)
    got = answers(overlapped, traffic_again(requests))
    assert got == expected
    assert got["resumed"][0] == whole[6:]
    assert all(3 <= t < 60 for t in got["masked"][0])


def test_a_request_aborted_or_failing_in_flight_changes_no_other_answer(tiny_torch_artifact):
    synchronous = core_of(tiny_torch_artifact, False, True)
    requests = traffic(synchronous)[:6]
    expected = answers(synchronous, requests)
    overlapped = core_of(tiny_torch_artifact, True, True)
    fresh = traffic_again(requests)
    # a prompt longer than the engine's rows fails its own request, found when its step is collected
    failing = Request("bad", [5] * (overlapped.engine.max_length + 10), greedy(2), reserve=1)
    got: dict = {}
    errors = {}
    for output in run_to_completion(overlapped, [*fresh, Request("gone", fresh[1].prompt_ids, greedy(40)), failing]):
        if output.error is not None:
            errors[output.request_id] = output.error
            continue
        got.setdefault(output.request_id, []).append(output.delta.token_id)
        if output.request_id == "gone" and len(got["gone"]) == 3:
            overlapped.abort("gone")  # its next step is already launched
    assert len(got["gone"]) <= 4  # the step in flight when it left may have delivered one more
    assert {r: got[r] for r in expected} == {r: tokens for r, (tokens, _, _) in expected.items()}
    assert set(errors) == {"bad"}
    assert not overlapped.has_work() and overlapped.engine.cache_tokens == 0 and len(overlapped.engine._free) == 4


def test_an_overflowed_best_score_is_chosen_on_the_device_as_token_chooser_does():
    """A repetition penalty of float range divides the seen positive logits to +inf: TokenChooser takes
    a uniform choice among the tokens at the top, with the token's own draw. The device does the same,
    in ``choose`` and in a step graph's choice, row by row beside ordinary rows."""
    vocab = 64
    settings = [dict(temperature=1.0, repetition_penalty=1e-300), dict(temperature=0.7, top_p=0.9),
                dict(temperature=1.3, repetition_penalty=1e-300, top_k=5), dict(temperature=0.0)]
    rows = len(settings)
    samplers = [DeviceSampler(rows + 1, vocab, torch.device("cpu")) for _ in range(2)]
    choosers = []
    seen = list(range(0, vocab, 3))
    for slot, extra in enumerate(settings):
        params = SamplingParams(max_new_tokens=50, seed=30 + slot, **extra)
        for sampler in samplers:
            sampler.start(slot, params, 30 + slot, seen, [])
        choosers.append(TokenChooser(params, 30 + slot, seen, []))
    by_choose, by_graph = samplers
    overflowed = 0
    for step in range(12):
        logits = (RNG.standard_normal((rows, vocab)) * 2 + 1).astype(np.float32)
        expected = [c.choose(logits[r], None) for r, c in enumerate(choosers)]
        got = by_choose.choose(list(range(rows)), torch.from_numpy(logits), [None] * rows)
        slots = list(range(rows))
        index = torch.tensor(slots)
        chosen = by_graph.graph_choice(index, torch.from_numpy(logits), torch.from_numpy(by_graph.draws(slots)))
        by_graph.commit(slots, index, chosen)
        from_graph = by_graph.settle(slots, torch.from_numpy(logits), chosen.numpy())
        assert got.tokens == expected and from_graph.tokens == expected, f"step {step}"
        assert not got.errors and not from_graph.errors
        overflowed += sum(logits[r, t] > 0 and t % 3 == 0 for r, t in ((0, expected[0]), (2, expected[2])))
    assert overflowed >= 12  # the overflowed rows chose among the seen positive logits


def test_a_launch_never_waits_and_a_collect_waits_once(tiny_torch_artifact):
    """Overlapped, the host queues a step without waiting on the device for anything (so it can plan
    the next one while the device computes), and waits once when it collects it: for the tokens."""
    from modelkiln.generation.engines.torch import transfers

    core = core_of(tiny_torch_artifact, True, True)
    requests = [r for r in traffic(core) if r.params.logprobs is None]  # those wait again, by design
    engine, seen = core.engine, []
    launch, collect = engine.launch, engine.collect

    def watched(call, name):
        def run(arg):
            before = transfers.host_waits
            with WaitingOps() as ops, ops.host_reads():
                out = call(arg)
            seen.append((name, transfers.host_waits - before, ops.found, getattr(out, "sampled", None)))
            return out
        return run

    engine.launch, engine.collect = watched(launch, "launch"), watched(collect, "collect")
    answers(core, requests)
    assert all(waits == 0 and not found for name, waits, found, _ in seen if name == "launch"), seen
    assert all(waits == (1 if sampled else 0) and not found for name, waits, found, sampled in seen
               if name == "collect"), seen
