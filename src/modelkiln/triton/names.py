"""Tensor names of the Triton ensemble, per task: what clients send and what they get back.

``kiln serve`` is meant to use the same names (TEXT, TEXT_PAIR, QUESTION, CONTEXT in; LABEL,
SCORES, EMBEDDING, ENTITIES, ANSWER, START, END, SCORE out), so one client works with both.
This module has no imports so it can be shared by the server, the CLI and the Triton models."""

from __future__ import annotations

# --- inputs (BYTES, one element per example) ---------------------------------------------------
TEXT = "TEXT"
TEXT_PAIR = "TEXT_PAIR"  # optional second text of a classification pair (NLI, rerankers)
QUESTION = "QUESTION"
CONTEXT = "CONTEXT"

# --- outputs ------------------------------------------------------------------------------------
LABEL = "LABEL"  # BYTES: top label
SCORES = "SCORES"  # FP32 [labels]: probabilities in manifest.labels order
EMBEDDING = "EMBEDDING"  # FP32 [d]: pooled (normalised when the manifest says so)
ENTITIES = "ENTITIES"  # BYTES: JSON list of {"entity_group","score","word","start","end"}
ANSWER = "ANSWER"  # BYTES
START = "START"  # INT64: character offset in CONTEXT
END = "END"  # INT64
SCORE = "SCORE"  # FP32

# task → (required inputs, optional inputs)
TASK_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "text-classification": ((TEXT,), (TEXT_PAIR,)),
    "sentence-embeddings": ((TEXT,), ()),
    "token-classification": ((TEXT,), ()),
    "question-answering": ((QUESTION, CONTEXT), ()),
}

TASK_OUTPUTS: dict[str, tuple[str, ...]] = {
    "text-classification": (LABEL, SCORES),
    "sentence-embeddings": (EMBEDDING,),
    "token-classification": (ENTITIES,),
    "question-answering": (ANSWER, START, END, SCORE),
}
