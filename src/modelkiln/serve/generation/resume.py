"""Resuming an answer that was cut: the client sends the same request again with
``resume_token_ids`` (the answer's token ids it has, as ``return_token_ids`` gives them) and the
answer's ``seed`` (every answer reports one), and the server streams the rest of the answer.

The rest is exactly what the first run would have sent, on any server of the same artifact: the
server prefills the prompt and feeds those tokens through decode steps, as the first run computed
them (``generation/core.py``), the draws are keyed by (seed, token index)
(``generation/sampling.py``), and the text state (detokenizer, held-back stop-string text, grammar)
is replayed through the tokens (``generation/sequence.py``). Usage counts the whole answer, as the
uninterrupted answer's would. kiln ray's router resumes the same way when a replica is lost."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer

from ...errors import InvalidInputError
from ...generation.sampling import SamplingParams
from ...generation.sequence import SequenceState

RESUME_FIELD = "resume_token_ids"
TOKEN_IDS_FIELD = "return_token_ids"  # vLLM's name: each choice (chunk) carries its token ids


def wants_token_ids(fields: Mapping[str, Any]) -> bool:
    value = fields.get(TOKEN_IDS_FIELD)
    if value is not None and not isinstance(value, bool):
        raise InvalidInputError(f"'{TOKEN_IDS_FIELD}' must be true or false, got {value!r}")
    return bool(value)


def checked_resume_ids(fields: Mapping[str, Any], prompt_ids: list[int], params: SamplingParams,
                       tokenizer: Tokenizer, eos_ids: Iterable[int], max_context: int) -> list[int]:
    """``resume_token_ids`` of a request, or [] when it has none. A 400 when they cannot be the
    start of this request's answer: not token ids, as long as the answer may be, already ending
    it, or a sampled answer without the seed it was drawn with."""
    ids = fields.get(RESUME_FIELD)
    if ids is None or ids == []:
        return []
    vocab = tokenizer.get_vocab_size()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                            for i in ids):
        raise InvalidInputError(f"'{RESUME_FIELD}' must be a list of token ids in [0, {vocab})")
    if len(ids) >= params.max_new_tokens:
        raise InvalidInputError(f"'{RESUME_FIELD}' has {len(ids)} tokens, and the answer has at most "
                                f"{params.max_new_tokens}: nothing is left to generate")
    if not params.greedy and params.seed is None:
        raise InvalidInputError(f"resuming a sampled answer needs the 'seed' it was drawn with (every answer "
                                f"reports its \"seed\"), next to '{RESUME_FIELD}'")
    try:  # the state the first run had after these tokens (what the engine core replays too)
        state = SequenceState("resume", prompt_ids, params, tokenizer, frozenset(eos_ids), max_context, resumed=ids)
    except Exception as exc:  # noqa: BLE001 - a token after the answer's end, or one its grammar refuses
        raise InvalidInputError(f"'{RESUME_FIELD}' is not the start of an answer to this request ({exc})") from None
    if state.finished:
        raise InvalidInputError(f"'{RESUME_FIELD}' already ends the answer (finish_reason "
                                f"{state.finish_reason!r}): nothing is left to generate")
    return ids
