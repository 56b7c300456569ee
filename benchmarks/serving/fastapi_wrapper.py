"""The embedding server many teams write first, as the baseline the issue names ("a FastAPI
wrapper"): FastAPI, one onnxruntime session, the fast tokenizer, one model call per request in
FastAPI's thread pool, no batching across requests. It runs the artifact's int8 model with the
same mean pooling and normalisation as kiln serve, so both answer the same vectors.

    KILN_WRAPPER_ARTIFACT=artifacts/all-MiniLM-L6-v2 uvicorn fastapi_wrapper:app --port 8001
(from benchmarks/; compare_servers.py starts it itself)."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer

FOLDER = os.environ["KILN_WRAPPER_ARTIFACT"]
tokenizer = Tokenizer.from_file(os.path.join(FOLDER, "tokenizer.json"))
tokenizer.enable_truncation(256)  # all-MiniLM-L6-v2's max_seq_length
tokenizer.enable_padding()
session = ort.InferenceSession(os.path.join(FOLDER, "model.int8.onnx"), providers=["CPUExecutionProvider"])
input_names = {i.name for i in session.get_inputs()}
app = FastAPI()


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: str | list[str]


@app.get("/health")
def health() -> dict:
    return {"ok": True}


@app.post("/v1/embeddings")
def embeddings(request: EmbeddingRequest) -> dict:
    texts = [request.input] if isinstance(request.input, str) else request.input
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    hidden = session.run(None, {k: v for k, v in feeds.items() if k in input_names})[0]
    weights = mask[..., None].astype(np.float32)
    vectors = (hidden * weights).sum(1) / weights.sum(1)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return {"object": "list", "model": request.model,
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}
