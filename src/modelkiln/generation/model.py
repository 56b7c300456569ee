"""A text-generation artifact, loaded without torch or transformers: its tokenizer, chat template,
end-of-sequence ids and decoder variants, and the engine and engine core built on them."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import ArtifactError
from ..manifest import Manifest, Variant
from ..tasks.text_generation import is_generation
from .chat import chat_messages, render_chat
from .chat_tokens import ChatTokens
from .core import DEFAULT_MAX_RUNNING, DEFAULT_PREFILL_CHUNK, Engine, EngineCore
from .engine import open_engine
from .prefix_cache import DEFAULT_MAX_TOKENS
from .sampling import SamplingParams


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
        return render_chat(self.chat_template or "", chat_messages(prompt, system), **self.template_tokens)

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
        if name and device == "cpu" and any(v.name == name for v in self.manifest.kept_variants()):
            return self.manifest.variant(name)
        return self.manifest.fastest_variant(device)

    def variant_path(self, variant: str | None = None, device: str = "cpu") -> tuple[str, Path]:
        chosen = self.manifest.variant(variant) if variant else self.default_variant(device)
        assert chosen.file is not None
        return chosen.name, self.folder / chosen.file

    @property
    def heads(self) -> int:
        return int(self.settings.get("heads") or 1)

    def engine(self, variant: str | None = None, threads: int | None = None, device: str = "cpu",
               max_rows: int = DEFAULT_MAX_RUNNING, memory_arena: bool = True,
               prefix_cache_tokens: int = DEFAULT_MAX_TOKENS) -> Engine:
        _, path = self.variant_path(variant, device)
        return self.engine_for_file(path, threads, device, max_rows, memory_arena, prefix_cache_tokens)

    def engine_for_file(self, path: Path, threads: int | None = None, device: str = "cpu",
                        max_rows: int = DEFAULT_MAX_RUNNING, memory_arena: bool = True,
                        prefix_cache_tokens: int = DEFAULT_MAX_TOKENS) -> Engine:
        """An engine on a graph file of this model (the converter's candidates are not variants yet)."""
        return open_engine(path, heads=self.heads, max_context=self.max_context, threads=threads, device=device,
                           max_rows=max_rows, memory_arena=memory_arena, prefix_cache_tokens=prefix_cache_tokens)

    def core(self, variant: str | None = None, threads: int | None = None, max_running: int = DEFAULT_MAX_RUNNING,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_logits: bool = False, device: str = "cpu") -> EngineCore:
        """An engine core on one variant, with nothing queued: ``core.complete`` or ``run_to_completion`` drive it."""
        _, path = self.variant_path(variant, device)
        return self.core_for_file(path, threads, max_running, prefill_chunk, keep_logits, device)

    def core_for_file(self, path: Path, threads: int | None = None, max_running: int = DEFAULT_MAX_RUNNING,
                      prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_logits: bool = False,
                      device: str = "cpu") -> EngineCore:
        engine = self.engine_for_file(path, threads, device, max_rows=max_running)
        return EngineCore(engine, self.tokenizer, self.eos_ids, max_running=max_running, prefill_chunk=prefill_chunk,
                          keep_logits=keep_logits)


def _generation_section(manifest: Manifest) -> dict:
    section = getattr(manifest, "generation", None)
    if not is_generation(manifest):
        raise ArtifactError(f"artifact '{manifest.name}' ({manifest.task}) is not a text-generation artifact")
    return section if isinstance(section, dict) else vars(section)
