"""The torch decoder's forward pass (generation/engines/torch/decoder.py) launches few kernels a layer:
the operators of one prompt step and one decode step of the torch engine, counted with a dispatch
mode on a 1-layer and a 2-layer tiny Llama; their difference is one layer's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from generation_helpers import make_tiny_llama
from modelkiln.convert.generation.torch_weights import save_weights
from modelkiln.generation.engines.torch.engine import TorchEngine, open_torch_engine
from modelkiln.generation.plan import Chunk, EngineOptions, ModelShape, SeqStart, StepPlan
from modelkiln.generation.sampling import SamplingParams

aten = torch.ops.aten
# Operators that make a new view of a tensor's memory (its shape, strides, offset) and launch nothing
# on a device: not kernels, so not counted.
VIEWS = {aten.view, aten._unsafe_view, aten.slice, aten.select, aten.t, aten.transpose, aten.expand, aten.as_strided,
         aten.detach, aten.alias, aten.unsqueeze, aten.squeeze, aten.permute, aten.split, aten.chunk, aten.unbind}
MOST_PER_LAYER = 12


class Operators(TorchDispatchMode):
    """Counts the operators that run, by name, views left out; a ``kiln::`` operator is one,
    whatever runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket not in VIEWS:
            self.counted[func.overloadpacket.__name__ if func.namespace == "aten" else str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def engine_of(folder) -> TorchEngine:
    import transformers as tf

    weights = folder / "model.torch-fp32.safetensors"
    save_weights(tf.AutoModelForCausalLM.from_pretrained(folder), weights, "fp32")
    return open_torch_engine(weights, ModelShape(4, 1024), EngineOptions(threads=1, max_rows=4))


def forward_operators(engine: TorchEngine) -> dict[str, Counter[str]]:
    """The operators of the forward pass of a 20-token prompt step, then of a decode step."""
    counted: list[Counter[str]] = []
    forward = engine.decoder.forward

    def counting(*args):
        with Operators() as operators:
            logits = forward(*args)
        counted.append(operators.counted)
        return logits

    engine.decoder.forward = counting
    seq, prompt = ("counted",), list(range(3, 23))
    engine.execute(StepPlan(starts=[SeqStart(seq, prompt, SamplingParams(max_new_tokens=4), seed=0)],
                            chunks=[Chunk(seq, 0, prompt, last=True)]))
    engine.execute(StepPlan(decode=[seq]))
    return dict(zip(("prompt", "decode"), counted))


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory) -> dict[str, Counter[str]]:
    one, two = (forward_operators(engine_of(make_tiny_llama(tmp_path_factory.mktemp(f"layers{n}"), layers=n)))
                for n in (1, 2))
    return {step: two[step] - one[step] for step in one}


@pytest.mark.parametrize("step", ["prompt", "decode"])
def test_a_layer_launches_at_most_twelve_kernels(per_layer, step):
    """One layer: two norms with the residual added, the rotary embedding with the cache write,
    attention and SiLU·up (one operator each), and the four matrix products."""
    layer = per_layer[step]
    assert sum(layer.values()) <= MOST_PER_LAYER, layer
    assert {name: layer[name] for name in layer if name.startswith("kiln.")} == {
        "kiln.add_rms_norm": 2, "kiln.rotary_kv_write": 1, "kiln.attention": 1, "kiln.silu_mul": 1}
