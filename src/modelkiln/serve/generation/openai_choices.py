"""One OpenAI choice built from its answer's deltas, streamed and whole: text, log-probabilities,
tool calls, the completion's echo, the finish reason.

Log-probabilities come from the engine on each delta (``Delta``): ``logprob`` (the chosen token's,
a float), ``top_logprobs`` (the k most likely tokens as (token id, log-probability) pairs), and, on
the first delta of an answer with ``prompt_logprobs``, ``prompt_logprobs``: one entry per prompt
token, None for the first, else (the prompt token's log-probability, its top (id, log-probability)
pairs). A delta without them contributes no entry. Each token's text and bytes come from the
model's ``Vocabulary``.

A streamed chunk carries the log-probabilities of the tokens since the last chunk: a token that
adds no text yet (half a character, a possible stop string) sends nothing, and its entry goes
out with the next chunk."""

from __future__ import annotations

from typing import Any

from ...generation.sequence import Delta
from ...generation.chat.tool_calls import Hermes, ToolCall, ToolFormat
from ...generation.structured_output.vocabulary import Vocabulary

TOOL_CALLS = "tool_calls"  # OpenAI's finish_reason when the answer is calls


def _pairs(delta: Delta, name: str) -> Any:
    return getattr(delta, name, None)


class ChatLogprobs:
    """``choices[].logprobs.content`` entries: token, logprob, bytes, top_logprobs."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self.pending: list[dict[str, Any]] = []

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.vocabulary.token_text(token), "logprob": logprob,
                "bytes": list(self.vocabulary.token_bytes(token))}

    def add(self, delta: Delta) -> None:
        logprob = _pairs(delta, "logprob")
        if logprob is None:
            return
        top = [self._entry(t, lp) for t, lp in (_pairs(delta, "top_logprobs") or ())]
        self.pending.append({**self._entry(delta.token_id, logprob), "top_logprobs": top})

    def take(self) -> dict[str, Any]:
        content, self.pending = self.pending, []
        return {"content": content, "refusal": None}


class CompletionLogprobs:
    """``choices[].logprobs``: tokens, token_logprobs, top_logprobs, text_offset (the prompt's
    first, with echo: its first token has no log-probability)."""

    def __init__(self, vocabulary: Vocabulary, offset: int = 0):
        self.vocabulary = vocabulary
        self.offset = offset  # characters of text before the next token (the echoed prompt's included)
        self.pending: dict[str, list[Any]] = self._empty()

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _token(self, token: int, logprob: float | None, top: Any) -> None:
        text = self.vocabulary.token_text(token)
        self.pending["tokens"].append(text)
        self.pending["token_logprobs"].append(logprob)
        self.pending["top_logprobs"].append(
            None if top is None else {self.vocabulary.token_text(t): lp for t, lp in top})
        self.pending["text_offset"].append(self.offset)
        self.offset += len(text)

    def add_prompt(self, prompt_ids: list[int], entries: Any) -> None:
        for i, token in enumerate(prompt_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            self._token(token, *(entry if entry is not None else (None, None)))

    def add(self, delta: Delta) -> None:
        logprob = _pairs(delta, "logprob")
        if logprob is not None:
            self._token(delta.token_id, logprob, _pairs(delta, "top_logprobs") or [])

    def take(self) -> dict[str, list[Any]]:
        out, self.pending = self.pending, self._empty()
        return out


class ToolStream:
    """Splits a streamed answer into content and tool calls as the template's syntax writes them:
    content goes out as it comes, except text that may start a call, which waits until it is one."""

    def __init__(self, tool_format: ToolFormat):
        self.format = tool_format
        self.buffer = ""
        self.in_call = False  # hermes: inside <tool_call>...; llama3_json: the answer began with '{'
        self.decided = isinstance(tool_format, Hermes)  # llama3_json: decided at the first visible character
        self.calls: list[ToolCall] = []
        self.space = ""  # trailing whitespace of the content sent so far, held back

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content to send now and the calls completed by ``text``."""
        self.buffer += text
        if not self.decided:
            stripped = self.buffer.lstrip()
            if not stripped:
                return "", []
            self.decided, self.in_call = True, stripped.startswith("{")
        if not isinstance(self.format, Hermes):
            if self.in_call:
                return "", []
            out, self.buffer = self.buffer, ""
            return out, []
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(Hermes.CLOSE)
                if end < 0:
                    break
                block = self.buffer[:end + len(Hermes.CLOSE)]
                self.buffer = self.buffer[end + len(Hermes.CLOSE):]
                self.in_call = False
                _, parsed = self.format.parse(Hermes.OPEN + block)
                if parsed:
                    self.space = ""  # whitespace before a call is not content
                    calls += parsed
                    self.calls += parsed
                else:
                    content += self._content(Hermes.OPEN + block)
                continue
            start = self.buffer.find(Hermes.OPEN)
            if start >= 0:
                content += self._content(self.buffer[:start])
                self.buffer = self.buffer[start + len(Hermes.OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, Hermes.OPEN)
            content += self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return content, calls

    def _content(self, text: str) -> str:
        """Content to send, less its trailing whitespace, which waits to see whether a call follows
        (the whole answer's content is stripped around its calls the same way)."""
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        return body if not self.calls or body.strip() else ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unfinished call is content after all."""
        left, self.buffer = self.buffer, ""
        if self.in_call and isinstance(self.format, Hermes):
            left = Hermes.OPEN + left
        elif self.in_call:
            content, calls = self.format.parse(left)
            self.calls += calls
            return content or "", calls
        left, self.space = self.space + left, ""
        return ("" if self.calls and not left.strip() else left), []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def tool_call_pieces(calls: list[ToolCall], first_index: int) -> list[dict[str, Any]]:
    """OpenAI's streamed ``delta.tool_calls``: per call, its id and name, then its arguments."""
    pieces = []
    for k, call in enumerate(calls, first_index):
        pieces.append({"index": k, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})
        pieces.append({"index": k, "function": {"arguments": call.arguments}})
    return pieces


def tool_calls_field(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class TokenIds:
    """vLLM's ``return_token_ids``: the answer's token ids; a streamed chunk carries those since the
    previous chunk (a token whose text is held back goes out with the next)."""

    def __init__(self) -> None:
        self.all: list[int] = []
        self.unsent: list[int] = []

    def add(self, delta: Delta) -> None:
        self.all.append(delta.token_id)
        self.unsent.append(delta.token_id)


def with_token_ids(choice: dict[str, Any], ids: TokenIds | None, whole: bool = False) -> dict[str, Any]:
    if ids is not None:
        choice["token_ids"] = ids.all if whole else ids.unsent
        ids.unsent = []
    return choice


class ChatChoice:
    """One chat choice: ``feed`` each delta (``stream``: returns the chunks' choice objects to
    send), ``whole()`` at the end (not streamed)."""

    def __init__(self, index: int, vocabulary: Vocabulary | None, logprobs: bool,
                 tool_format: ToolFormat | None = None, stream: bool = True, token_ids: bool = False):
        self.index = index
        self.stream = stream
        self.token_ids = TokenIds() if token_ids else None
        self.logprobs = ChatLogprobs(vocabulary) if logprobs and vocabulary else None
        self.tools = ToolStream(tool_format) if tool_format and stream else None
        self.tool_format = tool_format
        self.text = ""
        self.finish_reason: str | None = None
        self.sent_calls = 0

    def first(self) -> dict[str, Any]:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def _logprobs(self) -> Any:
        return self.logprobs.take() if self.logprobs else None

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        self.text += delta.text
        if self.logprobs:
            self.logprobs.add(delta)
        if self.token_ids:
            self.token_ids.add(delta)
        if not self.stream:
            self.finish_reason = delta.finish_reason
            return []
        content, calls = (self.tools.feed(delta.text) if self.tools else (delta.text, []))
        if delta.finish_reason is not None:
            if self.tools:
                more, late = self.tools.finish()
                content, calls = content + more, calls + late
            self.finish_reason = TOOL_CALLS if self.tools and self.tools.calls and delta.finish_reason == "stop" \
                else delta.finish_reason
        # one chunk per tool-call piece, as OpenAI streams them (clients such as instructor read
        # only a chunk's first tool_calls entry); the finish reason on the last one
        pieces: list[dict[str, Any]] = [{"content": content}] if content else []
        if calls:
            pieces += [{"tool_calls": [piece]} for piece in tool_call_pieces(calls, self.sent_calls)]
            self.sent_calls += len(calls)
        if not pieces:
            if delta.finish_reason is None:
                return []
            pieces = [{}]
        return [with_token_ids({"index": self.index, "delta": piece, "logprobs": self._logprobs() if k == 0 else None,
                                "finish_reason": self.finish_reason if k == len(pieces) - 1 else None}, self.token_ids)
                for k, piece in enumerate(pieces)]

    def whole(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        finish = self.finish_reason
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(self.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": tool_calls_field(calls)}
                finish = TOOL_CALLS if finish == "stop" else finish
        return with_token_ids({"index": self.index, "message": message, "logprobs": self._logprobs(),
                               "finish_reason": finish}, self.token_ids, whole=True)


class CompletionChoice:
    """One completion choice; ``echo``: the prompt's text (and its log-probabilities) first."""

    def __init__(self, index: int, vocabulary: Vocabulary | None, logprobs: bool, echo: str | None = None,
                 prompt_ids: list[int] | None = None, stream: bool = True, token_ids: bool = False):
        self.index = index
        self.stream = stream
        self.token_ids = TokenIds() if token_ids else None
        self.logprobs = CompletionLogprobs(vocabulary) if logprobs and vocabulary else None
        self.echo = echo
        self.prompt_ids = prompt_ids or []
        self.text = echo or ""
        self.finish_reason: str | None = None
        self.started = False

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        text = delta.text
        if not self.started:
            self.started = True
            if self.echo:
                text = self.echo + text
                if self.logprobs:
                    self.logprobs.add_prompt(self.prompt_ids, _pairs(delta, "prompt_logprobs"))
        self.text += delta.text
        if self.logprobs:
            self.logprobs.add(delta)
        if self.token_ids:
            self.token_ids.add(delta)
        self.finish_reason = delta.finish_reason
        if not self.stream or (not text and delta.finish_reason is None):
            return []
        return [with_token_ids({"index": self.index, "text": text,
                                "logprobs": self.logprobs.take() if self.logprobs else None,
                                "finish_reason": delta.finish_reason}, self.token_ids)]

    def whole(self) -> dict[str, Any]:
        return with_token_ids({"index": self.index, "text": self.text,
                               "logprobs": self.logprobs.take() if self.logprobs else None,
                               "finish_reason": self.finish_reason}, self.token_ids, whole=True)

