"""The gate's reference: PyTorch fp32 logits of given token sequences, and perplexity on paragraphs.

Two references compute the same thing:

- ``WholeModelReference``: transformers' whole model in fp32, a batch of sequences at a time
  (left-padded and masked, positions counted from each sequence's first token). It needs the
  model in memory: fine for a Hugging Face folder of a small model.
- ``LayerReference``: transformers' own decoder-layer modules, one layer's weights in memory at a
  time, on a GGUF file's dequantized weights (``gguf/decoder.py``, gguf-py's values: what
  transformers loads): every sequence goes through layer i before layer i + 1 is read; the head is
  applied a range of vocabulary rows at a time. Its memory is one layer's fp32 weights and the
  sequences' hidden states, so an 8B GGUF is checked on a 24 GB machine. It also applies what
  transformers' GGUF loading leaves out (llama.cpp's ``rope_freqs``), as the graph does.

Both write each sequence's logits to a ``LogitStore`` (keyed by the sequence's ids) and return
the paragraphs' perplexity; on a tiny model they agree (tests/test_generation_reference.py)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from .gate import nll_sum
from .logit_store import LogitStore

REFERENCE_BATCH = 8  # sequences run together (a forward reads the weights once for all)
LOGIT_CHUNK_BYTES = 32 << 20  # layer reference: logits of all positions for this many bytes of vocabulary


class Reference(Protocol):
    description: str

    def run(self, sequences: list[tuple[int, ...]], paragraphs: list[list[int]], store: LogitStore) -> float:
        """Write every sequence's logits [len, vocab] to ``store`` under the sequence; return the perplexity."""


class WholeModelReference:
    description = "pytorch fp32, the whole transformers model"

    def __init__(self, model: Any, batch: int = REFERENCE_BATCH):
        self.model, self.batch = model, batch

    def run(self, sequences: list[tuple[int, ...]], paragraphs: list[list[int]], store: LogitStore) -> float:
        import torch

        total, count = 0.0, 0
        rows = [list(s) for s in sequences] + paragraphs
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths together: little padding
        with torch.inference_mode():
            for start in range(0, len(order), self.batch):
                group = order[start:start + self.batch]
                logits = self._padded_forward([rows[i] for i in group], torch)
                for r, i in enumerate(group):
                    own = logits[r, logits.shape[1] - len(rows[i]):].numpy()
                    if i < len(sequences):
                        store.put(sequences[i], own)
                    else:
                        s, n = nll_sum(own, rows[i])
                        total, count = total + s, count + n
        return math.exp(total / max(count, 1))

    def _padded_forward(self, rows: list[list[int]], torch: Any) -> Any:
        width = max(len(ids) for ids in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # padding id 0: masked, never attended to
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):] = torch.tensor(row)
            mask[r, width - len(row):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()


class LayerReference:
    description = "pytorch fp32 layer by layer (transformers' decoder layers on the GGUF's dequantized weights)"

    # transformers' parameter names in a decoder layer (llama, mistral, qwen2) → the DecoderWeights role
    _LAYER = {"self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
              "self_attn.o_proj.weight": "o", "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
              "mlp.down_proj.weight": "down", "input_layernorm.weight": "input_norm",
              "post_attention_layernorm.weight": "post_attention_norm"}
    _BIASES = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias"}

    def __init__(self, decoder: Any):
        self.decoder = decoder  # gguf_decoder.GgufDecoder

    def run(self, sequences: list[tuple[int, ...]], paragraphs: list[list[int]], store: LogitStore) -> float:
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.decoder.config)
        config._attn_implementation = "sdpa"  # no mask: causal attention over the whole sequence
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        rows = [list(s) for s in sequences] + paragraphs
        # Sequences of similar lengths together, right-padded: attention is causal, so a real
        # position never sees the padding after it, and no mask is needed.
        order = sorted(range(len(rows)), key=lambda j: len(rows[j]))
        groups = [order[a:a + REFERENCE_BATCH] for a in range(0, len(order), REFERENCE_BATCH)]
        with torch.inference_mode():
            embedded = self._embed(rows, torch)
            hidden = [torch.nn.utils.rnn.pad_sequence([embedded[j] for j in g], batch_first=True) for g in groups]
            longest = max(len(r) for r in rows)
            positions = torch.arange(longest)[None]
            cos, sin = self._rotary(torch)(hidden[-1][:1, :1].expand(1, longest, -1), positions)
            for i in range(self.decoder.spec.layers):
                layer = skeleton.model.layers[i]
                layer.load_state_dict(self._layer_state(i, torch), assign=True)
                for k, h in enumerate(hidden):
                    n = h.shape[1]
                    hidden[k] = layer(h, attention_mask=None, position_ids=positions[:, :n],
                                      position_embeddings=(cos[:, :n], sin[:, :n]))
                skeleton.model.layers[i] = None  # its weights go with it
                self.decoder.release_pages()
            norm = skeleton.model.norm
            norm.load_state_dict({"weight": torch.from_numpy(self.decoder.tensor("final_norm"))}, assign=True)
            own = {j: norm(h[r, :len(rows[j])]) for g, h in zip(groups, hidden) for r, j in enumerate(g)}
            final = torch.cat([own[j] for j in range(len(rows))])  # [all positions, hidden], in the rows' order
            return self._head(final, rows, len(sequences), store, torch)

    def _embed(self, rows: list[list[int]], torch: Any) -> list[Any]:
        """Each sequence's embedding rows [len, hidden], dequantizing only the tokens used."""
        table = self.decoder.tensor("embed")
        used = sorted({t for r in rows for t in r})
        values = np.concatenate([table.rows(used[a:a + 4096]) for a in range(0, len(used), 4096)])
        index = {t: k for k, t in enumerate(used)}
        return [torch.from_numpy(values[[index[t] for t in r]]) for r in rows]

    def _rotary(self, torch: Any) -> Any:
        rotary = self.decoder.rotary_module()
        factors = self.decoder.rope_freq_factors()
        if factors is not None:
            rotary.inv_freq = rotary.inv_freq / torch.from_numpy(factors)
        return rotary

    def _layer_state(self, i: int, torch: Any) -> dict[str, Any]:
        def value(role: str) -> Any:
            weight = self.decoder.tensor(f"layers.{i}.{role}")
            return torch.from_numpy(weight if isinstance(weight, np.ndarray) else weight.full())

        state = {name: value(role) for name, role in self._LAYER.items()}
        if self.decoder.spec.qkv_bias:
            state.update({name: value(role) for name, role in self._BIASES.items()})
        return state

    def _head(self, final: Any, rows: list[list[int]], stored: int, store: LogitStore, torch: Any) -> float:
        """Logits a range of vocabulary rows at a time: the stored sequences' columns go to the
        store, the paragraphs' only feed a running log-sum-exp and their next tokens' logits."""
        head = self.decoder.tensor("lm_head")
        vocab = head.shape[0]
        starts = np.cumsum([0] + [len(r) for r in rows])
        first_rows = [store.reserve(tuple(rows[j]), len(rows[j])) for j in range(stored)]
        para = slice(int(starts[stored]), int(starts[-1]))
        targets = np.concatenate([r[1:] + [-1] for r in rows[stored:]]) if len(rows) > stored else np.zeros(0, np.int64)
        running_max = torch.full((para.stop - para.start,), -math.inf, dtype=torch.float64)
        running_sum = torch.zeros(para.stop - para.start, dtype=torch.float64)
        target_logit = torch.zeros(para.stop - para.start, dtype=torch.float64)
        chunk = max(256, LOGIT_CHUNK_BYTES // (4 * max(len(final), 1)))
        for a in range(0, vocab, chunk):
            b = min(a + chunk, vocab)
            logits = final @ torch.from_numpy(head.dequantized(a, b)).T  # [positions, b - a]
            for j in range(stored):
                store.put_columns(first_rows[j], a, logits[starts[j]:starts[j + 1]].numpy())
            if para.stop > para.start:
                part = logits[para]
                new_max = torch.maximum(running_max, part.max(dim=1).values.double())
                # each term is at most 1: their float32 sum over a chunk is exact enough; the rows' totals are float64
                terms = torch.exp(part - new_max.float()[:, None]).sum(dim=1, dtype=torch.float64)
                running_sum = running_sum * torch.exp(running_max - new_max) + terms
                running_max = new_max
                inside = (targets >= a) & (targets < b)
                hit = torch.from_numpy(np.flatnonzero(inside))
                target_logit[hit] = part[hit, torch.from_numpy(targets[inside] - a)].double()
            del logits
        self.decoder.release_pages()
        if para.stop == para.start:
            return float("nan")
        nll = (running_max + torch.log(running_sum)) - target_logit
        counted = torch.from_numpy(targets >= 0)
        return math.exp(float(nll[counted].sum()) / max(int(counted.sum()), 1))
