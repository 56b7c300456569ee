"""The gate's batch check on decoder files of an artifact: 8 STS-B sentences and 4 SQuAD chats, 32
greedy tokens each, alone vs among the others through the engine's batched path (as `kiln serve`).

    PYTHONPATH=src python benchmarks/invariance_experiments/alone_vs_batched.py ARTIFACT_DIR model.onnx model.int4.onnx ...
"""
import sys, time
from modelkiln.generation.model import TextGenerationModel
from modelkiln.generation.decoder import DecoderSession
from modelkiln.data import read_squad, sts_sentences
from modelkiln.convert.generation_gate import GatePrompts, onnx_run, check_batch_invariance
art = TextGenerationModel(sys.argv[1])
prompts = [art.prompt_ids(t) for t in sts_sentences()[:8]]
_, qs = read_squad(); seen = []
for q in qs:
    if q.context not in seen and len(seen) < 4:
        seen.append(q.context); prompts.append(art.prompt_ids(f"{q.context}\n\nQuestion: {q.question}\nAnswer briefly.", chat=True))
gate = GatePrompts(prompts, ["x"] * len(prompts), [])
for f in sys.argv[2:]:
    t = time.time(); d = DecoderSession(f"{sys.argv[1]}/{f}", threads=2)
    alone = onnx_run(d, gate, 32, 8192)
    inv = check_batch_invariance(d, gate, alone, 32, 8192)
    print(f, f"differing {inv.differing} of {len(prompts)}, max|d| {inv.max_abs_diff:.3g}, min cos {inv.min_cosine:.8f}, {time.time()-t:.0f}s", flush=True)
