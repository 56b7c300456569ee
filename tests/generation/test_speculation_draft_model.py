"""Speculative decoding with a draft model (generation/speculation/draft_model.py): the drafter's
calls and its rollback to the prefix its cache shares with the sequence, its slot given back when
the request ends, the option's errors, and, on the tiny Llama's KilnAttention serving graph,
answers equal to plain decoding's token for token and logit for logit (greedy and seeded sampled,
one stream and three): the target drafting for itself (every draft accepted under greedy) and a
perturbed copy of it drafting (some drafts refused)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tokenizers import ByteLevelBPETokenizer

from generation_helpers import SPECIALS, tiny_tokenizer, with_graph
from helpers import kiln
from modelkiln.errors import ArtifactError, KilnError
from modelkiln.generation.core import CoreHooks, EngineCore, Request, complete
from modelkiln.generation.engines.registry import EngineOptions
from modelkiln.generation.model import CoreOptions, TextGenerationModel, vocabulary_difference
from modelkiln.generation.sampling import SamplingParams
from modelkiln.generation.speculation import CallCosts, DraftModel, SpeculationOptions, Speculator
from modelkiln.generation.speculation.policy import PROBE_EVERY
from modelkiln.native import library_path
from modelkiln.samples import SAMPLE_TEXTS
from modelkiln.serve.settings import ServeSettings

needs_native = pytest.mark.skipif(library_path() is None, reason="the native library is not built on this machine")

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "one two three four one two three four one two",
           "Hello there, how are you today?"]
NOISE = 0.25  # the other draft model's weights perturbed by this share of their spread: about half its greedy drafts accepted
PARAMS = {"greedy": SamplingParams(max_new_tokens=24, ignore_eos=True),
          "sampled": SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=17, repetition_penalty=1.1,
                                    frequency_penalty=0.3, ignore_eos=True)}


# -- the drafter's calls, on an engine that records them --------------------------------------------------------


class RecordingEngine:
    """A draft engine whose greedy token after a sequence is ``next_of(tokens)``; it records every
    call and keeps each slot's tokens as the real engines keep its length."""

    max_context: int | None = 64

    def __init__(self, next_of):
        self.next_of = next_of
        self.slots: dict = {}
        self.calls: list = []

    def prefill(self, seq_id, token_ids, all_logits=False):
        self.calls.append(("prefill", list(token_ids)))
        tokens = self.slots.setdefault(seq_id, [])
        tokens += token_ids
        logits = np.zeros(16, dtype=np.float32)
        logits[self.next_of(tokens)] = 1.0
        return logits

    def truncate(self, seq_id, tokens):
        self.calls.append(("truncate", tokens))
        del self.slots[seq_id][tokens:]

    def remove(self, seq_id):
        self.calls.append(("remove",))
        del self.slots[seq_id]

    def __contains__(self, seq_id):
        return seq_id in self.slots


def test_the_drafter_feeds_what_is_new_then_one_call_a_drafted_token_and_rolls_back_refused_ones():
    engine = RecordingEngine(lambda tokens: (tokens[-1] + 1) % 12)  # the draft model counts up
    drafter = DraftModel(engine, vocab_size=16).drafter([1, 2, 3])
    assert drafter.propose(3) == [4, 5, 6]
    assert engine.calls == [("prefill", [1, 2, 3]), ("prefill", [4]), ("prefill", [5])]
    assert engine.slots[drafter.seq] == [1, 2, 3, 4, 5]  # k - 1 drafted tokens are in the cache
    engine.calls.clear()
    drafter.extend([4, 9])  # the target accepted 4, refused 5 and chose 9: back to [1, 2, 3, 4], then 9 fed
    assert drafter.propose(2) == [10, 11]
    assert engine.calls == [("truncate", 4), ("prefill", [9]), ("prefill", [10])]
    assert engine.slots[drafter.seq] == [1, 2, 3, 4, 9, 10]
    engine.calls.clear()
    drafter.extend([10, 11, 0])  # every draft accepted, and the token after: only what is new is fed
    assert drafter.propose(2) == [1, 2]
    assert engine.calls == [("prefill", [11, 0]), ("prefill", [1])]
    engine.calls.clear()
    drafter.extend([1])  # a proposal not verified that came true: all in the cache, the last token fed again
    assert drafter.propose(1) == [2]
    assert engine.calls == [("truncate", 8), ("prefill", [1])]
    drafter.close()
    assert drafter.seq not in engine and engine.calls[-1] == ("remove",)
    drafter.close()  # twice is harmless


def test_the_drafter_stops_at_ids_the_target_cannot_take_and_at_the_draft_models_context():
    engine = RecordingEngine(lambda tokens: 14 if len(tokens) >= 5 else 3)
    assert DraftModel(engine, vocab_size=12).drafter([1, 2, 3]).propose(4) == [3, 3]  # then 14: a padded row
    engine = RecordingEngine(lambda tokens: 3)
    engine.max_context = 5
    assert DraftModel(engine, vocab_size=12).drafter([1, 2, 3, 4]).propose(4) == [3, 3]  # 4 + 1 drafted fed: full
    assert DraftModel(engine, vocab_size=12).drafter(range(6)).propose(2) == []


def test_a_failing_draft_engine_ends_the_requests_drafting_not_the_request():
    def broken(tokens):
        raise RuntimeError("the draft engine failed")

    engine = RecordingEngine(broken)
    drafter = DraftModel(engine, vocab_size=16).drafter([1, 2])
    assert drafter.propose(3) == [] and drafter.stopped and drafter.seq not in engine
    assert drafter.propose(3) == []


def test_a_costly_drafter_is_asked_for_as_many_tokens_as_would_be_verified():
    engine = RecordingEngine(lambda tokens: 5)
    speculator = Speculator(DraftModel(engine, vocab_size=16).drafter([1, 2]), max_draft=8)
    for _ in range(20):
        speculator.verified(4, 0)  # nothing accepted: no draft pays
    engine.calls.clear()
    for _ in range(PROBE_EVERY - 1):
        assert speculator.draft([], limit=8, rows=1) == []
    assert engine.calls == []  # not asked at all...
    assert speculator.draft([], limit=8, rows=1) == []  # ...but for one token now and then, to measure
    assert len([c for c in engine.calls if c[0] == "prefill"]) == 1


def test_the_draft_models_own_calls_count_in_the_choice():
    """Every draft accepted, a verify call's extra tokens cheap: worth drafting while a drafted
    token's call is cheap against the target's, not where it costs as much as the target's step."""
    costs = CallCosts()
    for tokens, ms in ((1, 5.0), (2, 5.5), (3, 6.0), (5, 7.0), (9, 12.0)):
        costs.record(tokens, ms / 1000)
    for token_ms, drafts in ((0.5, True), (6.0, False)):
        model = DraftModel(RecordingEngine(lambda tokens: 5), vocab_size=16)
        model.measured(token_ms / 1000)
        speculator = Speculator(model.drafter([1, 2, 3]), max_draft=8)
        for _ in range(20):
            speculator.verified(4, 4)
        proposal = speculator.draft([], limit=8, rows=1, cost=costs.relative(1, model.token_seconds))
        assert bool(proposal) == drafts, (token_ms, proposal)
        if not drafts:  # not even probed: with every draft accepted it would not pay either
            for _ in range(2 * PROBE_EVERY):
                assert speculator.draft([], limit=8, rows=1, cost=costs.relative(1, model.token_seconds)) == []
            assert model.engine.calls == []


# -- the option ----------------------------------------------------------------------------------------------


def test_the_draft_model_option_is_required_with_the_method(tmp_path):
    with pytest.raises(ValueError, match="--speculate draft-model needs --draft-model"):
        SpeculationOptions("draft-model")
    assert SpeculationOptions("draft-model", draft_model=str(tmp_path)).on
    with pytest.raises(KilnError, match="--speculate draft-model needs --draft-model"):
        ServeSettings.from_env({}, speculate="draft-model")
    assert ServeSettings.from_env({}, speculate="draft-model", draft_model=str(tmp_path)).draft_model == str(tmp_path)


@pytest.fixture(scope="module")
def tiny(tiny_generation_artifact):
    return TextGenerationModel(tiny_generation_artifact)


def test_a_draft_model_must_be_a_generation_artifact_with_the_same_vocabulary(tiny, tiny_generation_artifact, tmp_path):
    with pytest.raises(ArtifactError, match=r"draft model .*nothing.*: .*nothing: no such file or folder"):
        tiny.draft_artifact(tmp_path / "nothing")
    encoder = shutil.copytree(tiny_generation_artifact, tmp_path / "not-generation")
    manifest = json.loads((encoder / "kiln.json").read_text())
    (encoder / "kiln.json").write_text(json.dumps({**manifest, "task": "sentence-embeddings"}))
    with pytest.raises(ArtifactError, match=r"draft model .*not-generation: .* is not a text-generation artifact"):
        tiny.draft_artifact(encoder)
    assert tiny.draft_artifact(tiny_generation_artifact).name == tiny.name
    assert vocabulary_difference(tiny.tokenizer, tiny_tokenizer(tmp_path / "again")) is None  # trained alike
    smaller = shutil.copytree(tiny_generation_artifact, tmp_path / "smaller-vocabulary")
    fewer = ByteLevelBPETokenizer()
    fewer.train_from_iterator(list(SAMPLE_TEXTS), vocab_size=300, min_frequency=1, special_tokens=SPECIALS)
    fewer.save(str(smaller / "tokenizer.json"))
    with pytest.raises(ArtifactError, match=r"its tokenizer is not .*'s \(vocabulary of 3\d\d tokens, not 4\d\d\)"):
        tiny.draft_artifact(smaller)
    swapped = shutil.copytree(tiny_generation_artifact, tmp_path / "swapped-tokens")
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[200]], vocab[by_id[201]] = 201, 200  # two tokens' ids swapped: the same size, another vocabulary
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ArtifactError, match=r"token 200 is .*, not "):
        tiny.draft_artifact(swapped)


def test_kiln_generate_refuses_the_method_without_a_good_draft_model(tiny_generation_artifact, tmp_path):
    missing = kiln("generate", str(tiny_generation_artifact), "hi", "--speculate", "draft-model")
    assert missing.returncode == 2 and "needs --draft-model" in missing.stderr and "Traceback" not in missing.stderr
    bad = kiln("generate", str(tiny_generation_artifact), "hi", "--speculate", "draft-model",
               "--draft-model", str(tmp_path))
    assert bad.returncode == 2 and "--draft-model" in bad.stderr and "not a modelkiln artifact" in bad.stderr
    assert "Traceback" not in bad.stderr


# -- answers on the KilnAttention graph ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def self_draft(tiny_generation_artifact, tiny_kiln_attention_graph, tmp_path_factory):
    """The tiny Llama's artifact with its KilnAttention graph as the default variant: the target
    drafting for itself."""
    return with_graph(tiny_generation_artifact, tiny_kiln_attention_graph, tmp_path_factory.mktemp("draft") / "self")


@pytest.fixture(scope="module")
def other_draft(tiny_generation_artifact, tmp_path_factory):
    """A draft model that agrees with the tiny Llama on some tokens only: its weights perturbed."""
    import torch
    import transformers

    from modelkiln.convert.generation.serving_graph import TorchDecoderWeights, build_serving_graph

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_generation_artifact.parent / "hf"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2:
                weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * NOISE)
    graph = tmp_path_factory.mktemp("other-graph") / "model.onnx"
    build_serving_graph(TorchDecoderWeights(model), graph, kiln_attention=True)
    return with_graph(tiny_generation_artifact, graph, tmp_path_factory.mktemp("draft") / "other")



class Counted(CoreHooks):
    def __init__(self):
        self.drafts = self.drafted = self.accepted = 0

    def speculated(self, request, drafted, accepted):
        self.drafts, self.drafted, self.accepted = self.drafts + 1, self.drafted + drafted, self.accepted + accepted


def core_for(tiny, graph, draft=None, draft_tokens: int = 4) -> tuple[EngineCore, Counted]:
    """A core on the KilnAttention graph; with ``draft``, speculation by that draft model's artifact,
    opened by the product's own ``TextGenerationModel.draft_model``."""
    engine = tiny.engine_for_file(graph, EngineOptions(threads=2, max_rows=8, keep_logits=True))
    assert engine.capabilities.verifies_drafts
    hooks = Counted()
    if draft is None:
        return EngineCore(engine, tiny.tokenizer, tiny.eos_ids, hooks=hooks), hooks
    speculation = SpeculationOptions("draft-model", draft_tokens, str(draft))
    draft_model = tiny.draft_model(CoreOptions(threads=2, max_running=8, speculation=speculation))
    # the policy weighs the draft model's measured calls, and the tiny draft costs about what the
    # tiny target does: unmeasured, drafting follows acceptance alone, whatever this machine's speed
    draft_model.measured = lambda seconds: None
    return EngineCore(engine, tiny.tokenizer, tiny.eos_ids, hooks=hooks, speculation=speculation,
                      draft_model=draft_model), hooks


def requests(core: EngineCore, name: str, params: SamplingParams) -> list[Request]:
    """One request a prompt, of 24, 18 and 12 tokens: three streams at once end one by one, so the
    last two draft (at most 2 decoding)."""
    import dataclasses

    return [Request((name, i), core.tokenizer.encode(text).ids, dataclasses.replace(params, max_new_tokens=24 - 6 * i))
            for i, text in enumerate(PROMPTS)]


def same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            and len(a.logits) == len(b.logits) and all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits)))


def answers_match_plain(tiny, graph, draft, kind) -> Counted:
    """Plain answers, then with the draft model one stream at a time and three at once: every
    token, text, finish reason and logit equal. Returns the drafting core's counters."""
    params = PARAMS[kind]
    plain_core, _ = core_for(tiny, graph)
    plain = complete(plain_core, requests(plain_core, "plain", params))
    core, counted = core_for(tiny, graph, draft)
    alone = [complete(core, [r])[0] for r in requests(core, "alone", params)]
    together = complete(core, requests(core, "together", params))
    assert all(same(a, b) for a, b in zip(alone, plain)), kind
    assert all(same(a, b) for a, b in zip(together, plain)), kind
    assert core.draft_model is not None and core.draft_model.engine.cache_tokens == 0  # every slot given back
    assert counted.drafts > 0
    return counted


@needs_native
@pytest.mark.parametrize("kind", list(PARAMS))
def test_the_target_drafting_for_itself(tiny, tiny_kiln_attention_graph, self_draft, kind):
    counted = answers_match_plain(tiny, tiny_kiln_attention_graph, self_draft, kind)
    if kind == "greedy":  # its own greedy tokens: every one accepted
        assert counted.accepted == counted.drafted > 0
    else:  # greedy drafts against sampled choices: some refused
        assert counted.accepted < counted.drafted


@needs_native
@pytest.mark.parametrize("kind", list(PARAMS))
def test_another_model_drafting(tiny, tiny_kiln_attention_graph, other_draft, kind):
    counted = answers_match_plain(tiny, tiny_kiln_attention_graph, other_draft, kind)
    assert counted.accepted < counted.drafted  # some refused (and the answers unchanged)
    if kind == "greedy":
        assert counted.accepted > 0


@needs_native
def test_an_aborted_request_gives_its_draft_slot_back(tiny, tiny_kiln_attention_graph, self_draft):
    core, counted = core_for(tiny, tiny_kiln_attention_graph, self_draft)
    core.add_request(Request("leaving", tiny.tokenizer.encode(PROMPTS[1]).ids, PARAMS["greedy"]))
    while counted.drafts < 2:
        core.step()
    assert core.draft_model is not None and core.draft_model.engine.cache_tokens > 0  # type: ignore[attr-defined]
    core.abort("leaving")
    core.step()
    assert not core.has_work() and core.draft_model.engine.cache_tokens == 0  # type: ignore[attr-defined]


@needs_native
def test_rollback_on_the_real_engine_gives_a_fresh_drafters_proposals(tiny, self_draft):
    """Refused drafts rolled back in the draft engine's slot: the next proposal is what a drafter
    fed the same sequence from scratch proposes (KilnAttention: the same bits in any chunks)."""
    speculation = SpeculationOptions("draft-model", 4, str(self_draft))
    draft = tiny.draft_model(CoreOptions(threads=2, max_running=4, speculation=speculation))
    prompt = tiny.tokenizer.encode(PROMPTS[0]).ids
    drafter = draft.drafter(prompt)
    first = drafter.propose(4)
    assert len(first) == 4 and draft.engine.length(drafter.seq) == len(prompt) + 3  # type: ignore[attr-defined]
    wrong = (first[1] + 1) % 400
    drafter.extend([first[0], wrong])
    again = drafter.propose(4)
    assert draft.engine.length(drafter.seq) == len(prompt) + 2 + 3  # type: ignore[attr-defined]
    fresh = draft.drafter([*prompt, first[0], wrong])
    assert fresh.propose(4) == again
    drafter.close()
    fresh.close()
    assert draft.engine.cache_tokens == 0  # type: ignore[attr-defined]


@needs_native
def test_kiln_generate_with_a_draft_model_answers_as_without(self_draft):
    args = [str(self_draft), "one two three four one two", "-n", "16", "--threads", "1", "--ignore-eos", "--json"]
    plain = json.loads(kiln("generate", *args).stdout)
    drafted = kiln("generate", *args, "--speculate", "draft-model", "--draft-model", str(self_draft))
    assert drafted.returncode == 0, drafted.stderr
    assert json.loads(drafted.stdout)["text"] == plain["text"]
