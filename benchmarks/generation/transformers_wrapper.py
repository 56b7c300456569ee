"""The generation server many teams write first, as the baseline the issue names ("a transformers
FastAPI wrapper"): FastAPI, ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` (the
GGUF dequantized to fp32 PyTorch weights), OpenAI-style ``/v1/chat/completions`` streamed with
``TextIteratorStreamer``, one ``generate`` call per request in its own thread, no batching across
requests, 2 torch threads.

    KILN_WRAPPER_GGUF=.../SmolLM2-135M-Instruct.Q4_1.gguf uvicorn transformers_wrapper:app --port 8002
(from benchmarks/; generation_servers.py starts it itself).

``ignore_eos`` (vLLM's extension, sent by load tests) is honoured as ``min_new_tokens = max_tokens``:
transformers then masks the end-of-sequence token until that many tokens are out, which is what
ignoring it means for a fixed-length answer."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

GGUF = Path(os.environ["KILN_WRAPPER_GGUF"])
MODEL_NAME = os.environ.get("KILN_WRAPPER_MODEL", "smollm2")
torch.set_num_threads(int(os.environ.get("KILN_WRAPPER_THREADS", "2")))
tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
app = FastAPI()


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stream: bool = False
    ignore_eos: bool = False
    stream_options: dict | None = None


@app.get("/v1/models")
def models() -> dict:
    return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "transformers"}]}


def generate_kwargs(request: ChatRequest, input_ids: torch.Tensor) -> dict:
    sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p} \
        if request.temperature > 0 else {"do_sample": False}
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "max_new_tokens": request.max_tokens,
            "min_new_tokens": request.max_tokens if request.ignore_eos else 0, **sampling}


def chunk(request_id: str, delta: dict, finish_reason: str | None = None, **extra: object) -> str:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL_NAME,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
    return f"data: {json.dumps(body)}\n\n"


@app.post("/v1/chat/completions", response_model=None)
def chat(request: ChatRequest) -> dict | StreamingResponse:
    messages = [m.model_dump() for m in request.messages]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    prompt_tokens = int(input_ids.shape[1])
    request_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
    if not request.stream:
        with torch.inference_mode():
            output = model.generate(**generate_kwargs(request, input_ids))[0, prompt_tokens:]
        text = tokenizer.decode(output, skip_special_tokens=True)
        finish = "length" if len(output) >= request.max_tokens else "stop"
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": MODEL_NAME,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(output),
                          "total_tokens": prompt_tokens + len(output)}}

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict[str, torch.Tensor] = {}

    def run() -> None:
        with torch.inference_mode():
            result["ids"] = model.generate(**generate_kwargs(request, input_ids), streamer=streamer)

    def events():  # a sync generator: Starlette iterates it in its thread pool
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        yield chunk(request_id, {"role": "assistant", "content": ""})
        for text in streamer:
            if text:
                yield chunk(request_id, {"content": text})
        worker.join()
        completion = int(result["ids"].shape[1]) - prompt_tokens
        yield chunk(request_id, {}, "length" if completion >= request.max_tokens else "stop")
        if (request.stream_options or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                     "total_tokens": prompt_tokens + completion}
            body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": MODEL_NAME, "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
