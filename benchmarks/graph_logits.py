"""Logits of candidate graphs against a reference graph on one real prompt (every position):
max |Δ| and how often the argmax agrees. Used to show that int4 packed from a GGUF's own blocks
holds the fp32 graph's weights (accuracy level 0: equal to float rounding).

    python benchmarks/graph_logits.py ARTIFACT REFERENCE.onnx NAME=CANDIDATE.onnx ... [--threads 2]"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort

from modelkiln.generation.model import TextGenerationModel
from modelkiln.runtime.onnx import session_options

PROMPT = "What is the capital of France? The capital of France is Paris, a city on the Seine."


def logits(path: str, ids: list[int], threads: int) -> np.ndarray:
    session = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
    past = session.get_inputs()[3]
    feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
             "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
    for i in session.get_inputs()[3:]:
        feeds[i.name] = np.zeros((1, past.shape[1], 0, past.shape[3]), np.float32)
    return session.run(["logits"], feeds)[0][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("reference")
    parser.add_argument("candidates", nargs="+", help="NAME=PATH")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ids = TextGenerationModel(args.artifact).prompt_ids(PROMPT)
    reference = logits(args.reference, ids, args.threads)
    for spec in args.candidates:
        name, path = spec.split("=", 1)
        got = logits(path, ids, args.threads)
        print(f"{name} vs reference: {len(ids)} positions, max |logit diff| {np.abs(got - reference).max():.2e} "
              f"(logits up to {np.abs(reference).max():.1f}), argmax equal at "
              f"{(got.argmax(-1) == reference.argmax(-1)).mean():.0%} of positions")


if __name__ == "__main__":
    main()
