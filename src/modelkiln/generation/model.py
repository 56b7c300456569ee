"""A text-generation artifact, loaded without torch or transformers: its tokenizer, chat template,
end-of-sequence ids and decoder variants, and the engine and engine core built on them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import ArtifactError
from ..manifest import Manifest, Variant
from ..native import check_layout, log_amx_refusal
from ..tasks.text_generation import is_generation
from .chat.templates import chat_messages, render_chat
from .chat.tokens import ChatTokens
from .core import DEFAULT_MAX_RUNNING, CoreHooks, EngineCore
from .engines.registry import EngineOptions, ModelShape, open_engine
from .plan import Engine
from .sampling import SamplingParams
from .speculation import DRAFT_MODEL, DraftEngine, DraftModel, SpeculationOptions

# The draft model's intra-op threads. onnxruntime's workers spin a while after a run, and two sessions
# taking turns on the same cores each find the other's worker spinning: SmolLM2-135M drafting for itself
# (2 cores, AMD EPYC Zen 5), 8 draft calls and the 9-token verify call took 8.1 ms each and 26 ms with
# both sessions on 2 threads, 6.7 and 12.8 ms with the draft model on 1 (5.0 and 10.6 in one session;
# with spinning off in the draft session 7.3 and 11.5). A draft model is small: one thread suffices.
DRAFT_THREADS = 1
# A draft model's tokenizer must be the target's: its vocabulary size (added tokens too), the tokens
# at these shares of the ids and at the end-of-sequence ids, and this text's ids are compared.
VOCABULARY_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
VOCABULARY_TEXT = "The quick brown fox, 42 times: {\"jumps\": [\"over\", \"the lazy dog\"]}\n\tdone."


class TextGenerationModel:
    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.manifest = Manifest.load(self.folder)
        self.settings = _generation_section(self.manifest)
        path = self.folder / self.manifest.tokenizer.file
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for missing/corrupt files
            raise ArtifactError(f"cannot load tokenizer {path}: {exc}") from exc
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def eos_ids(self) -> list[int]:
        return list(self.settings.get("eos_token_ids") or [])

    @property
    def max_context(self) -> int | None:
        return self.settings.get("max_context") or None

    @property
    def chat_template(self) -> str | None:
        return self.settings.get("chat_template")

    def default_params(self, **overrides) -> SamplingParams:
        """The artifact's default generation settings, with ``overrides`` (None values ignored)."""
        defaults = {k: v for k, v in (self.settings.get("defaults") or {}).items()
                    if k in SamplingParams.__dataclass_fields__}
        return SamplingParams(**{**defaults, **{k: v for k, v in overrides.items() if v is not None}})

    # -- prompts ---------------------------------------------------------------------------
    @property
    def template_tokens(self) -> dict[str, str]:
        """The special-token strings a chat template expects (bos_token, eos_token...)."""
        return {k: v for k, v in (self.settings.get("special_tokens") or {}).items() if isinstance(v, str)}

    def chat_prompt(self, prompt: str, system: str | None = None) -> str:
        return render_chat(self.chat_template or "", chat_messages(prompt, system), add_generation_prompt=True,
                           tools=None, **self.template_tokens)

    def chat_tokens(self, special_tokens_in_text: bool = False) -> ChatTokens:
        """Messages → prompt ids with the chat template; message text is text unless ``special_tokens_in_text``."""
        return ChatTokens(self.tokenizer, self.chat_template or "", self.template_tokens, special_tokens_in_text)

    @cached_property
    def _chat(self) -> ChatTokens:
        return self.chat_tokens()

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:  # the template writes its own special tokens; the prompt and system text are text
            return self._chat.ids(chat_messages(prompt, system))
        return self.tokenizer.encode(prompt).ids  # a plain prompt gets the tokenizer's special tokens

    # -- running ---------------------------------------------------------------------------
    def default_variant(self, device: str = "cpu") -> Variant:
        """The variant run when none is named: the one the converter chose (the fastest within its
        accuracy budget), else the fastest kept one (artifacts converted before it chose)."""
        name = self.settings.get("default_variant")
        if name and any(v.name == name and v.device == device for v in self.manifest.kept_variants()):
            return self.manifest.variant(name)
        return self.manifest.fastest_variant(device)

    def variant_path(self, variant: str | None = None, device: str = "cpu") -> tuple[str, Path]:
        chosen = self._chosen(variant, device)
        assert chosen.file is not None
        return chosen.name, self.folder / chosen.file

    def _chosen(self, variant: str | None, device: str) -> Variant:
        """The variant asked for (else the default for ``device``), if this kiln can run its graph."""
        chosen = self.manifest.variant(variant) if variant else self.default_variant(device)
        check_layout(chosen.details, chosen.name)
        return chosen

    @property
    def heads(self) -> int:
        return int(self.settings.get("heads") or 1)

    def engine(self, variant: str | None = None, options: EngineOptions = EngineOptions()) -> Engine:
        chosen = self._chosen(variant, options.device)
        assert chosen.file is not None
        engine = self.engine_for_file(self.folder / chosen.file, options, chosen.engine)
        log_amx_refusal(chosen.details)
        return engine

    def engine_for_file(self, path: Path, options: EngineOptions = EngineOptions(), kind: str | None = None) -> Engine:
        """An engine on a graph file of this model (the converter's candidates are not variants yet)."""
        return open_engine(path, kind, ModelShape(self.heads, self.max_context), options)

    def core(self, variant: str | None = None, options: CoreOptions | None = None,
             hooks: CoreHooks | None = None) -> EngineCore:
        """The engine core on one variant: what ``kiln serve``, the Triton model, ``kiln generate``,
        the gate and the bench all run, built here alone so they schedule alike."""
        chosen = self._chosen(variant, (options or CoreOptions()).device)
        assert chosen.file is not None
        core = self.core_for_file(self.folder / chosen.file, options, hooks, chosen.engine)
        log_amx_refusal(chosen.details)
        return core

    def core_for_file(self, path: Path, options: CoreOptions | None = None, hooks: CoreHooks | None = None,
                      kind: str | None = None) -> EngineCore:
        o = options or CoreOptions()
        engine = self.engine_for_file(path, EngineOptions(o.threads, o.device, o.max_running, 0, o.keep_logits,
                                                          o.memory_arena, o.batch_invariant,
                                                          o.kv_budget // o.kv_share if o.kv_budget else None), kind)
        budget = (o.kv_budget or engine.kv_capacity()) // o.kv_share
        prefix = o.prefix_cache_tokens if o.prefix_cache_tokens is not None else default_prefix_cache(budget)
        engine.use_prefix_cache(prefix)
        if o.warm_up:
            engine.warm_up()
        # the draft model only where the engine verifies drafts (elsewhere the core ignores speculation)
        drafting = o.speculation.method == DRAFT_MODEL and engine.capabilities.verifies_drafts
        return EngineCore(engine, self.tokenizer, self.eos_ids, max_running=o.max_running, max_waiting=o.max_waiting,
                          kv_budget=budget, prefill_chunk=o.prefill_chunk, hooks=hooks, speculation=o.speculation,
                          draft_model=self.draft_model(o) if drafting else None,
                          overlap=_overlaps(o, engine))

    # -- a draft model (speculative decoding) ------------------------------------------------
    def draft_artifact(self, folder: Path | str) -> TextGenerationModel:
        """The draft model's artifact, checked: a text-generation artifact whose tokenizer is this
        one's (``vocabulary_difference``); else an ArtifactError of one line naming --draft-model."""
        try:
            draft = TextGenerationModel(folder)
        except ArtifactError as exc:
            raise ArtifactError(f"draft model {folder}: {exc}") from None
        difference = vocabulary_difference(self.tokenizer, draft.tokenizer, self.eos_ids)
        if difference:
            raise ArtifactError(f"draft model {folder}: its tokenizer is not {self.name}'s ({difference}); a draft "
                                f"model must share the model's vocabulary")
        return draft

    def draft_model(self, options: CoreOptions) -> DraftModel:
        """The draft model's engine for ``--speculate draft-model``: its default variant, with a cache
        slot for each running sequence, on one thread (``DRAFT_THREADS``)."""
        o = options
        assert o.speculation.draft_model is not None  # SpeculationOptions requires it with the method
        draft = self.draft_artifact(o.speculation.draft_model)
        variant = draft._chosen(None, o.device)
        engine = draft.engine(variant.name, EngineOptions(DRAFT_THREADS, o.device, o.max_running, 0, False, o.memory_arena))
        if not isinstance(engine, DraftEngine):
            raise ArtifactError(f"draft model {draft.folder}: its variant {variant.name} cannot draft (it needs "
                                f"a serving graph: a GGUF variant, or a serving-graph ONNX variant)")
        if o.warm_up:
            engine.warm_up()
        return DraftModel(engine, self.tokenizer.get_vocab_size(with_added_tokens=True), f"draft model {draft.name}")


@dataclass(frozen=True)
class CoreOptions:
    """How a core and its engine run. ``kv_budget``: tokens of KV at most (None: what the engine
    says its device holds); ``prefix_cache_tokens``: None is ``default_prefix_cache`` of that
    budget, 0 none; ``keep_logits``: outputs carry their logits (the gate); ``warm_up``: run the
    engine once before the first request; ``batch_invariant``: the torch engine's invariant kernels
    (EngineOptions); ``kv_share``: cores sharing that budget (a server's engine replicas), each
    getting its fraction; ``speculation``: drafted tokens verified where the engine can (answers
    unchanged); ``overlap``: the core plans and launches a step while the device runs the one before,
    where the engine can (``EngineCore``; None: on a GPU, where the host's work then hides behind the
    device's; on the CPU the host is the device, and there is nothing to hide it behind)."""

    threads: int | None = None
    device: str = "cpu"
    max_running: int = DEFAULT_MAX_RUNNING
    max_waiting: int | None = None
    kv_budget: int | None = None
    prefill_chunk: int | None = None  # None: the engine's (EngineCapabilities.prefill_chunk), else the core's default
    prefix_cache_tokens: int | None = None
    keep_logits: bool = False
    warm_up: bool = False
    memory_arena: bool = True
    batch_invariant: bool = True
    kv_share: int = 1
    speculation: SpeculationOptions = SpeculationOptions()  # answers are the same with or without
    overlap: bool | None = None  # answers are the same with or without


# The default prefix cache: 1/8 of the KV budget, at most 2048 tokens. A bound that a busy server reaches
# within minutes, after which its memory stays flat; what pays is a few shared prefixes (system prompts), not
# every prompt's last blocks.
PREFIX_CACHE_SHARE = 8
PREFIX_CACHE_MAX_TOKENS = 2048


def _overlaps(options: CoreOptions, engine: Engine) -> bool:
    """Whether the core overlaps its steps (``CoreOptions.overlap``); never where every token keeps its
    logits (the gate's): they are read on the host after the step, before the next one may run."""
    if options.keep_logits:
        return False
    return options.overlap if options.overlap is not None else engine.capabilities.device == "cuda"


def default_prefix_cache(kv_budget: int) -> int:
    return min(kv_budget // PREFIX_CACHE_SHARE, PREFIX_CACHE_MAX_TOKENS)


def vocabulary_difference(target: Tokenizer, draft: Tokenizer, eos_ids: Iterable[int] = ()) -> str | None:
    """What differs between two tokenizers' vocabularies (None: the same, as far as compared): the
    vocabulary size with added tokens, the token at each share of the ids (``VOCABULARY_SHARES``)
    and at the end-of-sequence ids, and the ids of ``VOCABULARY_TEXT``."""
    size = target.get_vocab_size(with_added_tokens=True)
    other = draft.get_vocab_size(with_added_tokens=True)
    if size != other:
        return f"vocabulary of {other} tokens, not {size}"
    for token_id in sorted({round(share * (size - 1)) for share in VOCABULARY_SHARES} | set(eos_ids)):
        ours, theirs = target.id_to_token(token_id), draft.id_to_token(token_id)
        if ours != theirs:
            return f"token {token_id} is {theirs!r}, not {ours!r}"
    if target.encode(VOCABULARY_TEXT, add_special_tokens=False).ids != draft.encode(VOCABULARY_TEXT,
                                                                                    add_special_tokens=False).ids:
        return "a sample text's token ids differ"
    return None


def _generation_section(manifest: Manifest) -> dict:
    section = getattr(manifest, "generation", None)
    if not is_generation(manifest):
        raise ArtifactError(f"artifact '{manifest.name}' ({manifest.task}) is not a text-generation artifact")
    return section if isinstance(section, dict) else vars(section)
