"""``kiln generate MODEL PROMPT``: stream one answer to the terminal (or one JSON object). A command,
above the model cache it may convert into (so not inside generation/, which the cache's conversion uses). Its
sampling options are derived from the declaration of the sampling settings (``request/settings.py``),
as kiln serve's are from its settings: one option per setting, named after the request field."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

import typer

from .derived_options import DERIVED, DerivedOptionsCommand, keyword, typer_params
from .generation.request.settings import BOOL, FLOAT, INT, INTS, SETTINGS, from_command_line
from .generation.speculation import DEFAULT_DRAFT_TOKENS, DRAFT_MODEL, DRAFT_MODEL_HELP, DRAFT_TOKENS_HELP, METHOD_HELP, METHODS
from .model_arg import PRECISION, artifact_path

_TYPES = {FLOAT: Optional[float], INT: Optional[int], BOOL: bool, INTS: Optional[list[int]]}
# the command line's older name for a setting (Hugging Face's)
_FLAGS = {"max_tokens": ("--max-new-tokens", "-n")}


def _flags(name: str) -> tuple[str, ...]:
    return _FLAGS.get(name, ("--" + name.replace("_", "-"),))


def _in_option_names(message: str) -> str:
    """A settings error in the command line's words: each quoted field name (the request's, which the
    shared checks name) as its option."""
    for setting in SETTINGS:
        message = message.replace(f"'{setting.name}'", _flags(setting.name)[0])
    return message


class GenerateCommand(DerivedOptionsCommand):
    """``kiln generate`` with an option for every sampling setting, before ``--variant``."""

    insert_before = "variant"

    def derive(self) -> list[Any]:
        params = []
        for setting in SETTINGS:
            flags = _flags(setting.name)
            kind = _TYPES.get(setting.kind, Optional[list[str]])
            default = False if setting.kind == BOOL else None
            params.append(keyword(setting.name, kind, typer.Option(default, *flags, help=setting.help,
                                                                    show_default=False)))
        return typer_params(params)


def generate(
    ctx: typer.Context,
    artifact: str = typer.Argument(..., metavar="MODEL", help="A text-generation artifact folder, or a model (a .gguf file, a Hugging Face folder or hub id: converted once into the model cache)."),
    prompt: str = typer.Argument(..., help="The prompt (or the user message with --chat)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the artifact's chat template to the prompt."),
    system: Optional[str] = typer.Option(None, help="System message (with --chat)."),
    variant: Optional[str] = typer.Option(None, help="Variant to run (default: the fastest kept one)."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads (default: all cores)."),
    device: str = typer.Option("cpu", help="cpu or cuda: where the engine runs (a torch variant converted for cuda needs cuda)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object (text, tokens, timings) instead of streaming."),
    speculate: str = typer.Option("off", metavar="|".join(METHODS), help=METHOD_HELP),
    draft_tokens: int = typer.Option(DEFAULT_DRAFT_TOKENS, min=1, help=DRAFT_TOKENS_HELP),
    draft_model: Optional[str] = typer.Option(None, metavar="ARTIFACT", help=DRAFT_MODEL_HELP),
    precision: Optional[str] = PRECISION,
) -> None:
    """Generate text from PROMPT with a text-generation artifact, streaming tokens as they come."""
    from .errors import ArtifactError, InvalidInputError
    from .generation.core import Request, run_to_completion
    from .generation.model import CoreOptions, TextGenerationModel
    from .generation.request.params import sampling_params
    from .generation.speculation import SpeculationOptions

    try:
        speculation = SpeculationOptions(speculate, draft_tokens, draft_model)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--speculate") from None
    model = TextGenerationModel(artifact_path(artifact, precision=precision))
    if speculation.method == DRAFT_MODEL:
        try:
            model.draft_artifact(draft_model or "")  # checked before anything runs
        except ArtifactError as exc:
            raise typer.BadParameter(str(exc), param_hint="--draft-model") from None
    ids = model.prompt_ids(prompt, chat=chat, system=system)
    given = ctx.meta.get(DERIVED, {})
    fields = {s.name: from_command_line(s, given.get(s.name)) for s in SETTINGS}
    try:
        params = sampling_params(fields, model.default_params(), len(ids), model.max_context or model.manifest.max_length)
    except InvalidInputError as exc:
        raise InvalidInputError(_in_option_names(str(exc))) from None
    variant_name, _ = model.variant_path(variant, device)
    core = model.core(variant_name, CoreOptions(threads=threads, device=device, max_running=1,
                                                speculation=speculation))
    started = time.perf_counter()
    first_token_at = None
    pieces: list[str] = []
    tokens: list[int] = []
    finish_reason = None
    for event in run_to_completion(core, [Request("cli", ids, params)]):
        if event.error is not None:
            raise event.error
        delta = event.delta
        assert delta is not None  # an output is a token or an error
        first_token_at = first_token_at or time.perf_counter()
        tokens.append(delta.token_id)
        pieces.append(delta.text)
        finish_reason = delta.finish_reason or finish_reason
        if not json_output and delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - started
    ttft = (first_token_at or time.perf_counter()) - started
    decode_rate = (len(tokens) - 1) / (elapsed - ttft) if len(tokens) > 1 and elapsed > ttft else None
    summary = {"model": model.name, "variant": variant_name, "text": "".join(pieces), "finish_reason": finish_reason,
               "prompt_tokens": len(ids), "completion_tokens": len(tokens), "time_to_first_token_s": round(ttft, 4),
               "decode_tokens_per_s": round(decode_rate, 1) if decode_rate else None, "total_s": round(elapsed, 4)}
    if json_output:
        print(json.dumps(summary, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    rate = f", {decode_rate:.1f} tokens/s" if decode_rate else ""
    print(f"[{variant_name}: {len(ids)} prompt tokens, {len(tokens)} generated ({finish_reason}), "
          f"first token {ttft * 1000:.0f} ms{rate}]", file=sys.stderr)
