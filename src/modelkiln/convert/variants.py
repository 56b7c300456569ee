"""Building the faster variants from the fp32 export: transformer fusions, int8 (kiln's per-row
int8 for onnxruntime, NNCF's for OpenVINO), fp16.

Each builder takes a source .onnx and writes a new one; deciding what to keep is the validation
gate's and the latency measurement's job (convert/pipeline.py), not theirs."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .export import has_external_data

log = logging.getLogger(__name__)

# Hugging Face model types whose graphs ONNX Runtime's BERT optimizer knows how to fuse.
_BERT_LIKE = {"bert", "roberta", "distilbert", "electra", "xlm-roberta", "camembert", "mpnet", "albert", "ernie", "deberta-v2"}

# Ops whose reductions overflow or lose too much in fp16: left in fp32 when converting.
FP16_KEEP_FP32 = ["LayerNormalization", "SimplifiedLayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt", "Erf"]


def in_scratch_directory(builder: Callable[..., Any]) -> Callable[..., Any]:
    """Run an ONNX Runtime tool with a throw-away working directory. ORT's symbolic shape
    inference (called by its optimizer and quantizers) saves ``sym_shape_infer_temp.onnx`` and an
    external-data file with a uuid1 name into the *current* directory when inference is
    incomplete; that is how an 86 MiB ``<uuid>.data`` of MiniLM weights once got committed. Paths
    given to builders are absolute (the artifact's staging folder), so changing directory is safe."""

    @functools.wraps(builder)
    def run(*args: Any, **kwargs: Any) -> Any:
        previous = os.getcwd()
        with tempfile.TemporaryDirectory(prefix="kiln-ort-") as scratch:
            os.chdir(scratch)
            try:
                return builder(*args, **kwargs)
            finally:
                os.chdir(previous)

    return run


def attention_shape(config: Any) -> tuple[int, int]:
    """(num_heads, hidden_size): the optimizer cannot always infer them from the graph."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None) or 0
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", None) or 0
    return int(heads), int(hidden)


@in_scratch_directory
def optimize(src: Path, dst: Path, config: Any) -> dict[str, int]:
    """ONNX Runtime transformer fusions (Attention, SkipLayerNorm, BiasGelu, EmbedLayerNorm).
    Returns the fused-operator counts; raises ValueError for model types it does not handle."""
    from onnxruntime.transformers.optimizer import optimize_model

    if config.model_type not in _BERT_LIKE:
        raise ValueError(f"no transformer fusions for model type {config.model_type}")
    heads, hidden = attention_shape(config)
    model = optimize_model(str(src), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=1)
    model.save_model_to_file(str(dst), use_external_data_format=has_external_data(src))
    return {k: v for k, v in model.get_fused_operator_statistics().items() if v}


@contextlib.contextmanager
def _root_logger_at(level: int) -> Iterator[None]:
    root = logging.getLogger()
    previous = root.level
    root.setLevel(level)
    try:
        yield
    finally:
        root.setLevel(previous)


def materialize_transposed_weights(model: Any) -> int:
    """Replace ``MatMul(x, Transpose(W))`` of a constant ``W`` by ``MatMul(x, Wᵀ)``, with ``Wᵀ`` a new
    initializer. torch's exporter writes a tied output projection (the LM head sharing the token
    embedding) that way; ONNX Runtime folds the Transpose at load time, but the quantizers only
    quantize a MatMul whose weight is an initializer, so they skipped the largest MatMul of a
    small LM (SmolLM2's head is 28M of its 135M weights). The embedding's Gather keeps ``W``.
    Returns how many MatMuls were changed."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    changed = 0
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
        weight = numpy_helper.to_array(inits[transpose.input[0]])
        if weight.ndim != 2 or perm != [1, 0]:
            continue
        name = f"{transpose.input[0]}.transposed"
        if name not in inits:
            inits[name] = numpy_helper.from_array(weight.T.copy(), name)
            graph.initializer.append(inits[name])
        node.input[1] = name
        changed += 1
    if changed:  # drop the Transposes nothing reads any more
        read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if n.op_type == "Transpose" and not any(o in read for o in n.output)]
        for n in dead:
            graph.node.remove(n)
    return changed


def _load_untied(src: Path) -> Any:
    import onnx

    model = onnx.load(str(src))  # external data loaded too: the copies below need the values
    materialize_transposed_weights(model)
    return model


@in_scratch_directory
def quantize_int8(src: Path, dst: Path, per_channel: bool) -> None:
    """ONNX Runtime's dynamic int8 of MatMul/Attention weights (activations quantized at run time
    with ONE scale for the whole batch tensor, padding included: batch-variant, so the validation
    gate refuses it; kept for comparison, see benchmarks/encoders/batch_invariance.py)."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The quantizer logs advice about static-quantization pre-processing on the root logger at
    # WARNING on every call; it does not apply to dynamic quantization, so keep it off the terminal.
    with _root_logger_at(logging.ERROR):
        quantize_dynamic(
            str(src),
            str(dst),
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            use_external_data_format=has_external_data(src),
            # Fused contrib ops (Attention, BiasGelu) defeat shape inference; their outputs are float.
            extra_options={"DefaultTensorType": TensorProto.FLOAT},
        )


def quantize_int8_per_row(src: Path, dst: Path) -> int:
    """Batch-invariant int8 (convert/row_int8.py): int8 weights per output column, int8 activations
    with one scale per row (token), so a text's answer never depends on its batch neighbours.
    Returns the number of MatMuls quantized."""
    from .row_int8 import quantize_per_row

    return quantize_per_row(src, dst)


@in_scratch_directory
def quantize_int8_weights(src: Path, dst: Path, block_size: int, accuracy_level: int) -> None:
    """Weight-only 8-bit MatMul weights (MatMulNBits with bits=8, symmetric, one scale per
    ``block_size`` weights), for decoders. Dynamic int8 (``quantize_int8``) quantizes every
    activation per tensor to uint8, and a Llama-family residual stream carries a few outlier
    channels that take the whole range: SmolLM2's perplexity went from 26 to 11 million. Here the
    activations stay float (``accuracy_level`` 4: quantized per block of 32 inside the kernel)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level, bits=8)
    with _root_logger_at(logging.ERROR):
        quantizer = MatMulNBitsQuantizer(_load_untied(src), algo_config=config)
        quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


@in_scratch_directory
def quantize_int4(src: Path, dst: Path, block_size: int, accuracy_level: int, symmetric: bool = True,
                  exclude: tuple[str, ...] = ()) -> None:
    """Weight-only 4-bit MatMul weights (MatMulNBits, one scale per ``block_size`` weights, and one
    zero point too unless ``symmetric``); activations stay float. On CPU, decoding reads every
    weight once per token, so 4-bit weights cut the bytes read per token by ~8× against fp32.
    ``accuracy_level`` 4 lets the kernel compute in int8. ``exclude``: MatMul nodes left in fp32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with _root_logger_at(logging.ERROR):
        quantizer = MatMulNBitsQuantizer(_load_untied(src), block_size=block_size, is_symmetric=symmetric,
                                         accuracy_level=accuracy_level, nodes_to_exclude=list(exclude))
        quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


def quantize_openvino_int8(src: Path, dst: Path, calibration: Sequence[dict[str, Any]]) -> None:
    """NNCF's post-training int8 of the exported graph for OpenVINO, written as an IR (``dst`` .xml and
    its .bin): int8 weights per output channel, and activations with scales measured once on
    ``calibration`` (one feed dict per input) and fixed in the graph, so a text's answer does not
    depend on its batch neighbours (unlike onnxruntime's dynamic int8). The transformer model type
    keeps NNCF's float where int8 is known to hurt such graphs (layer norms, softmax's inputs)."""
    import nncf
    import openvino

    model = openvino.Core().read_model(str(src))
    # NNCF draws progress bars on the terminal and logs its choices at INFO: kiln convert shows
    # its own steps, so both stay off the terminal (errors still raise)
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            quantized = nncf.quantize(model, nncf.Dataset(list(calibration)), model_type=nncf.ModelType.TRANSFORMER,
                                      subset_size=len(calibration))
    finally:
        nncf_log.setLevel(level)
    openvino.save_model(quantized, str(dst), compress_to_fp16=False)


@in_scratch_directory
def to_fp16(src: Path, dst: Path) -> None:
    """fp16 weights and activations for CUDA, keeping inputs/outputs and reduction ops in fp32."""
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnx.load(str(src)))
    model.convert_float_to_float16(keep_io_types=True, op_block_list=FP16_KEEP_FP32)
    model.save_model_to_file(str(dst), use_external_data_format=has_external_data(src))


def tensorrt_version() -> str | None:
    try:
        import tensorrt
    except ImportError:
        return None
    return str(tensorrt.__version__)
