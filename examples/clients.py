"""Call a running `kiln serve` of a sentence-embeddings model with four ordinary clients, unmodified:

  tritonclient.http  Open Inference Protocol (KServe v2) over HTTP, with binary tensors
  tritonclient.grpc  the same protocol over gRPC (kiln serve's --grpc-port, 8001 by default)
  httpx              the task-shaped JSON route, /v2/models/{model}/predict
  openai             the OpenAI-compatible /v1/embeddings route

    kiln serve artifacts/all-MiniLM-L6-v2 &      # or `kiln serve` for the embedded default model
    python examples/clients.py --url http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --model all-MiniLM-L6-v2

The clients come with `pip install 'modelkiln[test]'` (or: pip install 'tritonclient[http,grpc]' httpx openai).
Each prints one line; the answers must agree, or the script exits 1. `--grpc-url ''` skips gRPC.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

TEXTS = ["A man is playing a flute.", "A man is playing a bamboo flute."]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def with_tritonclient(url: str, model: str) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.split("://", 1)[-1])
    text = httpclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=True)
    result = client.infer(model, [text], outputs=[httpclient.InferRequestedOutput("EMBEDDINGS", binary_data=True)])
    embeddings = result.as_numpy("EMBEDDINGS")
    print(f"tritonclient (binary): {embeddings.shape} {embeddings.dtype} cosine: {cosine(*embeddings):.4f}")
    return embeddings


def with_tritonclient_grpc(url: str, model: str) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    text = grpcclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    result = client.infer(model, [text], outputs=[grpcclient.InferRequestedOutput("EMBEDDINGS")])
    embeddings = result.as_numpy("EMBEDDINGS")
    print(f"tritonclient.grpc: {embeddings.shape} {embeddings.dtype} cosine: {cosine(*embeddings):.4f}")
    return embeddings


def with_httpx(url: str, model: str) -> np.ndarray:
    import httpx

    response = httpx.post(f"{url}/v2/models/{model}/predict", json={"inputs": TEXTS}, timeout=30)
    response.raise_for_status()
    embeddings = np.asarray(response.json(), dtype=np.float32)
    print(f"httpx /predict: {len(embeddings)} vectors of {embeddings.shape[1]} floats cosine: {cosine(*embeddings):.4f}")
    return embeddings


def with_openai(url: str, model: str) -> np.ndarray:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")  # kiln serve --api-key KEY: pass KEY here
    response = client.embeddings.create(model=model, input=TEXTS)
    embeddings = np.asarray([item.embedding for item in response.data], dtype=np.float32)
    print(f"openai: {len(embeddings)} embeddings of {embeddings.shape[1]} floats; usage {response.usage.total_tokens} tokens")
    return embeddings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="kiln serve's address")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="its gRPC address ('' to skip gRPC)")
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="a sentence-embeddings model it serves")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    calls = [("tritonclient", with_tritonclient, url)]
    if args.grpc_url:
        calls.append(("tritonclient.grpc", with_tritonclient_grpc, args.grpc_url))
    calls += [("httpx", with_httpx, url), ("openai", with_openai, url)]
    answers = [client(address, args.model) for _, client, address in calls]
    # The embeddings are unit-normalised by the server or not, the same way for every route: compare directions.
    for (name, _, _), other in zip(calls[1:], answers[1:]):
        worst = min(cosine(a, b) for a, b in zip(answers[0], other))
        if worst < 0.9999:
            print(f"{name} disagrees with tritonclient (cosine {worst:.6f})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
