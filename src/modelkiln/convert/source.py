"""The model being converted: its config, tokenizer, task and PyTorch module.

This is the only place that asks transformers what a model is and can do."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import ModelLoadError, TaskNotSupportedError, UnsupportedArchitectureError
from ..manifest import Pooling
from ..tasks import TASKS, task_class

log = logging.getLogger(__name__)

# Architecture-name suffix → the task its head was trained for.
_HEAD_SUFFIXES = {
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForCausalLM": "text-generation",  # converted by convert/generation/pipeline.py, not a tasks/ Task
    "LMHeadModel": "text-generation",  # GPT-2, GPT-J and other early causal LMs' class names
}
# Heads that carry no task head of ours: fine for embeddings, not for head tasks.
_BASE_SUFFIXES = ("Model", "ForMaskedLM", "ForPreTraining")


@dataclass
class SourceModel:
    """A Hugging Face model folder (or hub id) with everything conversion needs to know."""

    ref: str
    config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerFast; None when loaded without (load_source)
    folder: Path | None  # local folder (for sentence-transformers configs), None for hub ids
    gguf_file: str | None = None  # a .gguf file's name inside ``folder``: transformers dequantizes it to fp32

    @property
    def load_ref(self) -> str:
        """What ``from_pretrained`` is given (with ``load_kwargs``)."""
        return str(self.folder) if self.gguf_file else self.ref

    @property
    def gguf_path(self) -> Path | None:
        return self.folder / self.gguf_file if self.folder is not None and self.gguf_file else None

    @property
    def load_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def architecture(self) -> str:
        archs = getattr(self.config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def st_file(self, relative: str) -> Any:
        """A sentence-transformers json file of the model, parsed, if present (else None): modules.json
        is a list, the others objects."""
        if self.folder is None:
            return None
        path = self.folder / relative
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is corrupt: {exc}") from exc


GGUF_MAGIC = b"GGUF"


def find_gguf(ref: str) -> Path | None:
    """The .gguf file ``ref`` names: the file itself, or the only one in a folder without config.json.
    A file that is not GGUF fails here, with its first bytes named."""
    path = Path(ref)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ModelLoadError(f"{ref} holds {len(found)} .gguf files; name one of them")
        if not found:
            return None
        path = found[0]
    if not path.is_file():
        return None
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{ref} is not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r}); "
                             "expected a model folder, a hub id or a .gguf file")
    return path


# The last GGUF file parsed (see ``one_gguf_parse``): (realpath, size, mtime) → gguf.GGUFReader.
_parsed_gguf: dict[tuple[str, int, int], Any] = {}


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within this block, transformers' reads of a GGUF file share one parse of it.

    transformers reads a GGUF file (for architectures its newer reader does not cover, Llama among
    them) with gguf-py's ``GGUFReader``, which parses every metadata field in Python: SmolLM2's
    49k-token vocabulary and merges are ~150k fields, 10-30 s on 2 busy cores. It does so anew for
    the config, for the tokenizer and for the weights, so a conversion parsed the file four times
    and ``kiln bench``'s PyTorch row four more. The reader memory-maps the file read-only and
    transformers only reads from it, so one reader per file (kept for the next block: the weights
    are loaded after the tokenizer) serves all of them. Keyed by size and mtime: a rewritten file
    is parsed again."""
    try:
        import gguf
    except ImportError:  # transformers says which package is missing when it needs it
        yield
        return
    parse: Any = gguf.GGUFReader

    def shared_reader(path: Any, mode: str = "r") -> Any:
        if mode != "r":
            return parse(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in _parsed_gguf:
            _parsed_gguf.clear()  # one file at a time: a reader holds ~100 MB of parsed fields
            _parsed_gguf[key] = parse(path, mode)
        return _parsed_gguf[key]

    gguf.GGUFReader = shared_reader  # type: ignore[misc, assignment]  # patched on purpose: transformers calls gguf.GGUFReader
    try:
        yield
    finally:
        gguf.GGUFReader = parse  # type: ignore[misc]  # the class put back


def forget_gguf_parse() -> None:
    """Drop the kept parse (``one_gguf_parse``): for a reader of the tensors alone, its metadata is dead weight."""
    _parsed_gguf.clear()


def load_gguf_source(ref: str, path: Path, with_tokenizer: bool = True) -> SourceModel:
    """Config and tokenizer from a GGUF file's metadata (transformers needs the gguf package)."""
    with one_gguf_parse():
        return _load_gguf_source(ref, path, with_tokenizer)


def _load_gguf_source(ref: str, path: Path, with_tokenizer: bool) -> SourceModel:
    from transformers import AutoConfig, AutoTokenizer

    folder, name = path.resolve().parent, path.name
    try:  # parsed here first (and kept: one_gguf_parse), so that a bad file is named as such
        import gguf

        gguf.GGUFReader(str(path))
    except ImportError:
        pass  # transformers names the missing package below
    except Exception as exc:  # gguf-py raises ValueError, IndexError, struct errors... on a truncated or corrupt file
        raise ModelLoadError(f"{ref} is not a readable GGUF file (truncated or corrupt?): "
                             f"{str(exc).splitlines()[0] or type(exc).__name__}") from exc
    try:
        config = AutoConfig.from_pretrained(str(folder), gguf_file=name)
    except ValueError as exc:  # "GGUF model with architecture X is not supported yet"
        raise UnsupportedArchitectureError(f"{ref}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # a truncated file, the gguf package missing...
        raise ModelLoadError(f"cannot read the GGUF metadata of {ref}: {str(exc).splitlines()[0]}") from exc
    tokenizer = None
    try:
        if with_tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    except Exception as exc:  # transformers raises many kinds here; all mean "no usable tokenizer"
        raise ModelLoadError(f"cannot load the tokenizer of {ref}: {str(exc).splitlines()[0]}") from exc
    if not getattr(config, "architectures", None):
        config.architectures = [_causal_lm_class_name(config)]
    return SourceModel(ref=ref, config=config, tokenizer=tokenizer, folder=folder, gguf_file=name)


def _causal_lm_class_name(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    try:
        # a model mapping's value is the model class (transformers annotates every mapping's as a tokenizer pair)
        return cast(type, AutoModelForCausalLM._model_mapping[type(config)]).__name__
    except KeyError:
        return f"{type(config).__name__.removesuffix('Config')}ForCausalLM"


HUB_PROBE_SECONDS = 3.0


def hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _probe(endpoint: str) -> BaseException | None:
    """None when ``endpoint`` answers an HTTP request (any status), else the error."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return None  # the hub answered: it is reachable
    except (OSError, ValueError) as exc:  # URLError, refused, DNS failure, timeout, malformed HF_ENDPOINT
        return exc
    return None


def check_hub_reachable(ref: str) -> None:
    """Fail in seconds, with one line, when ``ref`` is a hub id and the hub cannot be reached: without this,
    huggingface_hub retries for about 30 s and prints a line per retry. With HF_HUB_OFFLINE=1 the local
    hub cache is used and nothing is probed."""
    if hub_offline():
        return
    import threading

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    outcome: list[BaseException | None] = []
    # In a daemon thread: urlopen's timeout does not cover a DNS lookup, which can hang on a dead resolver.
    probe = threading.Thread(target=lambda: outcome.append(_probe(endpoint)), daemon=True)
    probe.start()
    probe.join(HUB_PROBE_SECONDS + 1)
    error = outcome[0] if outcome else TimeoutError(f"no answer in {HUB_PROBE_SECONDS + 1:.0f} s")
    if error is not None:
        reason = getattr(error, "reason", error)
        raise ModelLoadError(
            f"{ref} is not a local folder and the Hugging Face hub ({endpoint}) cannot be reached ({reason}): "
            "pass a local model folder, or set HF_HUB_OFFLINE=1 to use the local hub cache"
        ) from error


def is_hub_id(ref: str) -> bool:
    """Whether ``ref``, which names nothing here, may be a hub id: "name" or "org/name"; anything else
    is a missing folder."""
    return not (Path(ref).is_absolute() or ref.startswith((".", "~")) or ref.count("/") > 1)


def load_source(ref: str, with_tokenizer: bool = True) -> SourceModel:
    """Load config and fast tokenizer (``with_tokenizer=False``: the config only, for a reference
    that only runs the weights); one-line errors for missing or corrupt files."""
    gguf = find_gguf(ref)
    if gguf is not None:
        return load_gguf_source(ref, gguf, with_tokenizer)
    folder = Path(ref)
    is_local = folder.exists()
    if not is_local and not is_hub_id(ref):
        raise ModelLoadError(f"model folder {ref} does not exist")
    if is_local and not folder.is_dir():
        raise ModelLoadError(f"{ref} is a file; expected a model folder or a hub id")
    if is_local and not (folder / "config.json").is_file():
        raise ModelLoadError(f"{ref} has no config.json: not a Hugging Face model folder")
    if not is_local:
        check_hub_reachable(ref)
    from transformers import AutoConfig, AutoTokenizer  # after the checks: importing it takes seconds

    try:
        config = AutoConfig.from_pretrained(ref)
    except ValueError as exc:
        raise UnsupportedArchitectureError(f"{ref}: {str(exc).splitlines()[0]}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the config of {ref}: {str(exc).splitlines()[0]}") from exc
    if not with_tokenizer:
        return SourceModel(ref=ref, config=config, tokenizer=None, folder=folder if is_local else None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref)
    except Exception as exc:  # transformers raises many kinds here; all mean "no usable tokenizer"
        raise ModelLoadError(f"cannot load the tokenizer of {ref}: {str(exc).splitlines()[0]}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{ref} has no fast tokenizer (tokenizer.json); the serving path needs one")
    return SourceModel(ref=ref, config=config, tokenizer=tokenizer, folder=folder if is_local else None)


def detect_task(source: SourceModel) -> str:
    """auto: a sentence-transformers model → embeddings; else the head named by the architecture."""
    if source.st_file("modules.json") is not None:
        return "sentence-embeddings"
    arch = source.architecture
    for suffix, task in _HEAD_SUFFIXES.items():
        if arch.endswith(suffix):
            return task
    if not arch or arch.endswith(_BASE_SUFFIXES):
        return "sentence-embeddings"
    raise TaskNotSupportedError(
        f"cannot tell the task of architecture {arch}; pass --task ({', '.join(TASKS)})"
    )


def check_task_fits(source: SourceModel, task: str) -> None:
    """A head task needs weights trained for that head; a random new head would 'work' silently."""
    task_class(task)  # unknown task names fail here first
    arch = source.architecture
    trained_for = next((t for s, t in _HEAD_SUFFIXES.items() if arch.endswith(s)), None)
    if task_class(task).info.pooled:
        return  # every encoder has hidden states to pool
    if trained_for != task:
        what = f"was trained for {trained_for}" if trained_for else "has no task head"
        raise TaskNotSupportedError(f"{source.ref}: architecture {arch or source.model_type} {what}; it cannot do {task}")


def read_pooling(source: SourceModel) -> Pooling:
    """Pooling from sentence-transformers' 1_Pooling/config.json and a Normalize module."""
    modules = source.st_file("modules.json")
    if not modules:
        return Pooling(mode="mean", normalize=True)
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling_dir = next((m.get("path") for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    cfg = source.st_file(f"{pooling_dir}/config.json") if pooling_dir else None
    mode = "mean"
    if cfg:
        if cfg.get("pooling_mode_cls_token"):
            mode = "cls"
        elif cfg.get("pooling_mode_max_tokens"):
            mode = "max"
        elif cfg.get("pooling_mode_mean_sqrt_len_tokens") or cfg.get("pooling_mode_weightedmean_tokens"):
            raise UnsupportedArchitectureError(f"{source.ref}: pooling mode {cfg} is not supported (mean, cls, max are)")
    return Pooling(mode=mode, normalize=normalize)


def max_length(source: SourceModel) -> int:
    """The longest input: sentence-transformers' max_seq_length, else tokenizer and position limits."""
    candidates = []
    st = source.st_file("sentence_bert_config.json")
    if isinstance(st, dict) and st.get("max_seq_length"):
        candidates.append(int(st["max_seq_length"]))
    tok_max = getattr(source.tokenizer, "model_max_length", None)
    if tok_max and tok_max < 1_000_000:
        candidates.append(int(tok_max))
    positions = max_positions(source)
    if positions:
        candidates.append(positions)
    return min(candidates) if candidates else 512


def max_positions(source: SourceModel) -> int | None:
    """The longest sequence the position embeddings allow (bench may go past max_length)."""
    positions = getattr(source.config, "max_position_embeddings", None)
    if not positions:
        return None
    # RoBERTa-style position ids start after the padding index.
    offset = 2 if source.model_type in ("roberta", "xlm-roberta", "camembert", "mpnet") else 0
    return int(positions) - offset


def load_torch_model(source: SourceModel, task: str) -> Any:
    """The PyTorch module for the task, in eval mode, with plain (eager) attention: it exports to
    the graph that ONNX Runtime's transformer fusions recognise."""
    import transformers

    auto = {
        "text-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
        "question-answering": transformers.AutoModelForQuestionAnswering,
        "sentence-embeddings": transformers.AutoModel,
    }[task]
    try:
        model = auto.from_pretrained(source.ref, attn_implementation="eager")
    except ValueError as exc:
        raise UnsupportedArchitectureError(
            f"{source.ref}: {source.model_type} is not supported for {task}: {str(exc).splitlines()[0]}"
        ) from exc
    except Exception as exc:  # OSError, safetensors' and torch's own errors: all mean unreadable weights
        raise ModelLoadError(f"cannot load the weights of {source.ref}: {str(exc).splitlines()[0]}") from exc
    return model.eval()


def labels_of(source: SourceModel, task: str) -> list[str] | None:
    if not task_class(task).info.labelled:
        return None
    id2label = getattr(source.config, "id2label", None) or {}
    return [str(id2label.get(i, f"LABEL_{i}")) for i in range(source.config.num_labels)]


def input_names(source: SourceModel, model: Any) -> list[str]:
    """The tokenizer's model_input_names that the model's forward actually takes, in that order.
    Never assume token_type_ids: RoBERTa, DistilBERT and others have none."""
    import inspect

    accepted = set(inspect.signature(model.forward).parameters)
    names = [n for n in source.tokenizer.model_input_names if n in accepted]
    if "input_ids" not in names:
        raise UnsupportedArchitectureError(f"{source.ref}: the model does not take input_ids")
    return names
