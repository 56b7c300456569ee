"""One answer as OpenAI's Responses API writes it: the response object and, streamed, its events.

The answer's deltas go through the chat route's own parts: ``ToolStream`` splits the text into
content and tool calls as the template's syntax writes them, ``ChatLogprobs`` writes each token's
log-probabilities (openai_choices.py). Content becomes a ``message`` output item with one
``output_text`` part; each call a ``function_call`` item (``call_id``, ``name``, ``arguments``).
A whole answer is written by the same code with its events dropped, so it is the streamed one.

Events, each with a ``sequence_number`` from 0: ``response.created``, ``response.in_progress``;
per message ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; per call ``response.output_item.added``,
``response.function_call_arguments.delta``, ``.done``, ``response.output_item.done``; then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` (or the context)
cut the answer (status ``incomplete``, ``incomplete_details.reason`` ``max_output_tokens``), as
OpenAI sends them. A failure mid-answer is an ``error`` event, then ``response.failed``."""

from __future__ import annotations

import copy
import itertools
import os
import time
from typing import Any

from ...errors import ErrorKind, KilnError
from ...generation.sequence import Delta
from ...generation.chat.tool_calls import ToolCall, ToolFormat
from ...generation.structured_output.vocabulary import Vocabulary
from .openai_choices import ChatLogprobs, ToolStream

LENGTH = "length"


def new_id(kind: str) -> str:
    """OpenAI's ids: ``resp_``, ``msg_``, ``fc_`` and 48 hex digits."""
    return f"{kind}_{os.urandom(24).hex()}"


def new_response(model: str, echo: dict[str, Any], temperature: float, top_p: float, store: bool) -> dict[str, Any]:
    """The response object before its answer: status ``in_progress``, no output. ``echo``: the
    request's fields a response repeats (responses_request.py); temperature and top_p the ones used."""
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, **echo, "model": model, "output": [],
            "reasoning": {"effort": None, "summary": None}, "store": store, "temperature": temperature,
            "top_p": top_p, "truncation": "disabled", "usage": None}


class ResponseWriter:
    """Feed each delta of the answer (``feed``: its events); ``response`` is the response object,
    complete once the last delta was fed."""

    def __init__(self, response: dict[str, Any], prompt_tokens: int, tool_format: ToolFormat | None = None,
                 vocabulary: Vocabulary | None = None):
        self.response = response
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.tools = ToolStream(tool_format) if tool_format is not None else None
        self.logprobs = ChatLogprobs(vocabulary) if vocabulary is not None else None
        self._numbers = itertools.count()
        self._message: dict[str, Any] | None = None  # the message item being written
        self._index = 0  # its place in the output

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._numbers), **fields}

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        self.output_tokens += 1
        if self.logprobs is not None:
            self.logprobs.add(delta)
        content, calls = self.tools.feed(delta.text) if self.tools is not None else (delta.text, [])
        if delta.finish_reason is not None and self.tools is not None:
            more, late = self.tools.finish()  # an unfinished call is content after all
            content, calls = content + more, calls + late
        events = self._text(content) if content else []
        for call in calls:
            events += self._close_message("completed") + self._call(call)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    # -- a message item with one output_text part ------------------------------------------------
    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._index = len(self.response["output"])
            self._message = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self.response["output"].append(self._message)
            events.append(self._event("response.output_item.added", output_index=self._index,
                                      item=copy.deepcopy(self._message)))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                      output_index=self._index, content_index=0, part=copy.deepcopy(part)))
        part = self._message["content"][0]
        logprobs = self.logprobs.take()["content"] if self.logprobs is not None else []
        part["text"] += text
        part["logprobs"] += logprobs
        if text:
            events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                      output_index=self._index, content_index=0, delta=text, logprobs=logprobs))
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message["content"][0]
        if self.logprobs is not None:  # tokens whose text was held back (the end-of-sequence token's)
            part["logprobs"] += self.logprobs.take()["content"]
        message["status"] = status
        where = {"item_id": message["id"], "output_index": self._index}
        return [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part)),
                self._event("response.output_item.done", output_index=self._index, item=copy.deepcopy(message))]

    # -- a function_call item --------------------------------------------------------------------
    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        if self.logprobs is not None:
            self.logprobs.take()  # a call's tokens: the Responses API reports no log-probabilities for them
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        index = len(self.response["output"])
        self.response["output"].append(item)
        events = [self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item)),
                  self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=call.arguments)]
        item.update(arguments=call.arguments, status="completed")
        return events + [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=call.name, arguments=call.arguments),
                         self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    # -- the end ---------------------------------------------------------------------------------
    def _finish(self, finish_reason: str) -> list[dict[str, Any]]:
        cut = finish_reason == LENGTH
        events = self._text("") if not self.response["output"] else []  # an empty answer is an empty message
        events += self._close_message("incomplete" if cut else "completed")
        self.response.update(
            status="incomplete" if cut else "completed", completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": self.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                   "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": self.prompt_tokens + self.output_tokens})
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self._snapshot())]

    def fail(self, exc: KilnError) -> list[dict[str, Any]]:
        """The events of an answer that failed midway (a timeout, a grammar past its limits)."""
        code = "invalid_prompt" if exc.kind is ErrorKind.INVALID_INPUT else "server_error"
        self.response.update(status="failed", error={"code": code, "message": str(exc)})
        return [self._event("error", code=exc.kind.value, message=str(exc), param=None),
                self._event("response.failed", response=self._snapshot())]
