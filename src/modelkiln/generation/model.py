"""A text-generation artifact, loaded without torch or transformers: its tokenizer, chat template,
end-of-sequence ids and decoder variants, and the engine and generator built on them."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from ..errors import ArtifactError
from ..manifest import Manifest
from ..tasks.text_generation import is_generation
from .chat import chat_messages, render_chat
from .decoder import DecoderSession
from .engine import GenerationEngine
from .generator import Generator
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
    def chat_prompt(self, prompt: str, system: str | None = None) -> str:
        special = {k: v for k, v in (self.settings.get("special_tokens") or {}).items() if isinstance(v, str)}
        return render_chat(self.chat_template or "", chat_messages(prompt, system), **special)

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        text = self.chat_prompt(prompt, system) if chat else prompt
        # A chat template writes its own special tokens; a plain prompt gets the tokenizer's.
        return self.tokenizer.encode(text, add_special_tokens=not chat).ids

    # -- running ---------------------------------------------------------------------------
    def variant_path(self, variant: str | None = None, device: str = "cpu") -> tuple[str, Path]:
        chosen = self.manifest.variant(variant) if variant else self.manifest.fastest_variant(device)
        assert chosen.file is not None
        return chosen.name, self.folder / chosen.file

    def decoder(self, variant: str | None = None, threads: int | None = None, device: str = "cpu") -> DecoderSession:
        _, path = self.variant_path(variant, device)
        return DecoderSession(path, device=device, threads=threads)

    def generator(self, variant: str | None = None, threads: int | None = None, max_batch: int = 32,
                  device: str = "cpu") -> Generator:
        engine = GenerationEngine(self.decoder(variant, threads, device), self.max_context)
        return Generator(engine, self.tokenizer, self.eos_ids, max_batch)


def _generation_section(manifest: Manifest) -> dict:
    section = getattr(manifest, "generation", None)
    if not is_generation(manifest):
        raise ArtifactError(f"artifact '{manifest.name}' ({manifest.task}) is not a text-generation artifact")
    return section if isinstance(section, dict) else vars(section)
