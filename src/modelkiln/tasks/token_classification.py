"""Token classification (NER and friends): per-token tags grouped into entities with character
offsets, like the Hugging Face pipeline's "simple" aggregation."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from tokenizers import Encoding

from .tensors import TensorSpec
from . import tensors as t
from .base import Task, TaskInfo, TextInput, softmax


def split_tag(label: str) -> tuple[str, str]:
    """"B-PER" → ("B", "PER"); "PER" → ("I", "PER"); "O" → ("O", "")."""
    if label == "O":
        return "O", ""
    if len(label) > 2 and label[1] == "-" and label[0] in "BIES":
        return label[0], label[2:]
    return "I", label


class TokenClassification(Task):
    info = TaskInfo("token-classification", ("logits",), truncation="longest_first", per_token=True, labelled=True)
    outputs = (t.ENTITIES,)
    answers_need_text = True  # entities carry character offsets and words

    # -- protocol ----------------------------------------------------------------------------
    def output_specs(self, model_outputs: Mapping[str, Sequence[int]]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(t.ENTITIES, "BYTES", (-1,)),)  # one JSON list of entities per input

    @classmethod
    def tensors_from_answers(cls, labels: Sequence[str], answers: Sequence[Any]) -> dict[str, np.ndarray]:
        return {t.ENTITIES: t.bytes_tensor([json.dumps(entities) for entities in answers])}

    @classmethod
    def answers_from_tensors(cls, labels: Sequence[str], tensors: Mapping[str, np.ndarray]) -> list[Any]:
        return [json.loads(e) for e in t.text_column(t.ENTITIES, tensors[t.ENTITIES])]

    # -- answers -----------------------------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        return self.manifest.labels or []

    def _token_tags(self, logits: np.ndarray, encoding: Encoding) -> list[tuple[int, float, tuple[int, int]]]:
        """(label index, score, char offsets) for each real, non-special token."""
        n = len(encoding.ids)
        probs = softmax(logits[:n].astype(np.float32))
        special = encoding.special_tokens_mask
        tags = []
        for t in range(n):
            if special[t]:
                continue
            k = int(probs[t].argmax())
            tags.append((k, float(probs[t, k]), encoding.offsets[t]))
        return tags

    def entities(self, tags: list[tuple[int, float, tuple[int, int]]], text: str) -> list[dict]:
        groups: list[dict] = []
        current: dict | None = None
        for k, score, (start, end) in tags:
            prefix, kind = split_tag(self.labels[k])
            if prefix == "O":
                current = None
                continue
            if current is not None and prefix in "IE" and current["entity_group"] == kind:
                current["end"] = end
                current["scores"].append(score)
            else:
                current = {"entity_group": kind, "start": start, "end": end, "scores": [score]}
                groups.append(current)
            if prefix in "ES":
                current = None
        result = []
        for g in groups:
            result.append(
                {
                    "entity_group": g["entity_group"],
                    "score": float(np.mean(g["scores"])),
                    "word": text[g["start"] : g["end"]],
                    "start": int(g["start"]),
                    "end": int(g["end"]),
                }
            )
        return result

    def postprocess(
        self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding], inputs: Sequence[TextInput]
    ) -> list[list[dict]]:
        logits = outputs["logits"]
        texts = cast(Sequence[str], inputs)  # prepare() takes single texts only, no pairs
        return [self.entities(self._token_tags(logits[i], enc), texts[i]) for i, enc in enumerate(encodings)]

    def task_vector(self, outputs: dict[str, np.ndarray], encodings: Sequence[Encoding]) -> list[np.ndarray]:
        logits = outputs["logits"].astype(np.float32)
        return [softmax(logits[i, : len(enc.ids)]).ravel() for i, enc in enumerate(encodings)]

    def agreement(self, reference: list[list[dict]], candidate: list[list[dict]]) -> float:
        def key(entities: list[dict]) -> list[tuple]:
            return [(e["entity_group"], e["start"], e["end"]) for e in entities]

        return float(np.mean([key(r) == key(c) for r, c in zip(reference, candidate)]))
