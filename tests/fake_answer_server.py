"""A small server that answers right when a request is alone and wrong under load, so that the
tests can prove ``kiln loadtest --check`` catches each kind of wrong answer (a check that only
ever saw right answers could pass by doing nothing).

Run as ``python fake_answer_server.py PORT``. The model name picks the fault that appears while
another request is in flight:

- ``wrong-text``: another word in the answer;
- ``bad-framing``: events separated by one newline instead of a blank line;
- ``bad-usage``: usage counts one token more than were sent;
- ``no-done``: OpenAI streams end without ``data: [DONE]``;
- ``mid-stream-error``: an error event after the first token;
- ``good``: never wrong;
- ``triton-like``: never wrong, and its generate_stream events carry text only, as Triton's do
  (no finish reason, no token counts).

Routes: OpenAI ``/v1/chat/completions`` and ``/v1/completions`` (streamed), Triton's
``/v2/models/{m}/generate_stream``, and an Open Inference Protocol ``/v2/models/{m}/infer`` that
answers an embedding of the text (``wrong-text``: a different vector under load; ``good``: always
the same), with the metadata and health routes kiln loadtest asks for."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

app = FastAPI()
in_flight = 0


def words_for(prompt: str) -> list[str]:
    """A deterministic answer: 6 'tokens' derived from the prompt."""
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    return [f" w{digest[i:i + 3]}" for i in range(0, 18, 3)]


def sse(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def answer(model: str, prompt: str, protocol: str):
    global in_flight
    in_flight += 1
    try:
        await asyncio.sleep(0.02)  # let concurrent requests overlap
        loaded = in_flight > 1
        fault = model if loaded else "good"
        words = words_for(prompt)
        if fault == "wrong-text":
            words[3] = " wrong"
        for i, word in enumerate(words):
            last = i == len(words) - 1
            if protocol == "generate":
                event = {"model_name": model, "text_output": word}
                if last and model != "triton-like":  # Triton sends output tensors only: no finish, no counts
                    event.update(finish_reason="length", prompt_tokens=3,
                                 completion_tokens=len(words) + (fault == "bad-usage"))
            elif protocol == "chat":
                event = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": "length" if last else None}]}
            else:
                event = {"choices": [{"index": 0, "text": word, "finish_reason": "length" if last else None}]}
            chunk = sse(event)
            if fault == "bad-framing":
                chunk = chunk[:-1]  # "data: {...}\n": no blank line after the event
            yield chunk
            if fault == "mid-stream-error" and i == 0:
                yield sse({"error": {"message": "engine failed", "type": "internal_error"}})
                return
            await asyncio.sleep(0.005)
        if protocol != "generate":
            usage = len(words) + (fault == "bad-usage")
            yield sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage,
                                                "total_tokens": 3 + usage}})
            if fault != "no-done":
                yield b"data: [DONE]\n\n"
    finally:
        in_flight -= 1


@app.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    body = await request.json()
    return StreamingResponse(answer(body["model"], body["messages"][-1]["content"], "chat"),
                             media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await request.json()
    return StreamingResponse(answer(body["model"], body["prompt"], "completions"), media_type="text/event-stream")


@app.post("/v2/models/{name}/generate_stream")
async def generate_stream(request: Request, name: str) -> Response:
    body = await request.json()
    return StreamingResponse(answer(name, body["text_input"], "generate"), media_type="text/event-stream")


@app.get("/v2/health/ready")
async def ready() -> Response:
    return Response(status_code=200)


@app.get("/v2/models/{name}")
async def metadata(name: str) -> Response:
    return JSONResponse({"name": name, "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
                         "outputs": [{"name": "EMBEDDINGS", "datatype": "FP32", "shape": [-1, 8]},
                                     {"name": "LABEL", "datatype": "BYTES", "shape": [-1]}]})


@app.post("/v2/models/{name}/infer")
async def infer(request: Request, name: str) -> Response:
    global in_flight
    body = await request.json()
    texts = body["inputs"][0]["data"]
    in_flight += 1
    try:
        await asyncio.sleep(0.01)
        loaded = in_flight > 1
    finally:
        in_flight -= 1
    vectors = []
    for text in texts:
        digest = hashlib.sha256(text.encode()).digest()
        vector = [b / 255 - 0.5 for b in digest[:8]]
        if loaded and name == "wrong-text":
            vector[0] += 0.05  # cosine about 0.99: wrong for an encoder
        vectors.extend(vector)
    labels = ["long" if len(t) > 40 else "short" for t in texts]
    return JSONResponse({"model_name": name, "outputs": [
        {"name": "EMBEDDINGS", "datatype": "FP32", "shape": [len(texts), 8], "data": vectors},
        {"name": "LABEL", "datatype": "BYTES", "shape": [len(texts)], "data": labels}]})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
