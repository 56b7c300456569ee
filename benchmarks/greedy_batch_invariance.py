"""Each prompt's greedy tokens alone vs decoded among the others through the engine (the gate's batch check,
convert/generation_gate.py check_batch_invariance) on a SmolLM2 artifact: N STS-B sentences and M SQuAD
questions as chats, 32 tokens.  Run: PYTHONPATH=src python benchmarks/greedy_batch_invariance.py N M FILE.onnx..."""
import sys, time
import numpy as np
from modelkiln.generation.model import TextGenerationModel
from modelkiln.data import read_squad, sts_sentences
from modelkiln.convert.generation_gate import GatePrompts, onnx_run, check_batch_invariance
from modelkiln.generation.decoder import DecoderSession

art = TextGenerationModel("/work/main/artifacts/smollm2")
n_sts, n_chat = int(sys.argv[1]), int(sys.argv[2])
prompts = [art.prompt_ids(t, chat=True) for t in sts_sentences()[:n_sts]]  # STS-B sentences as chats, like loadtest
_, qs = read_squad()
seen = []
for q in qs:
    if q.context not in seen and len(seen) < n_chat:
        seen.append(q.context)
        prompts.append(art.prompt_ids(f"{q.context}\n\nQuestion: {q.question}\nAnswer briefly.", chat=True))
gate = GatePrompts(prompts, ["x"] * len(prompts), [])
print("prompt lengths", [len(p) for p in prompts], flush=True)
for path in sys.argv[3:]:
    t = time.time()
    session = DecoderSession(path, threads=2)
    alone = onnx_run(session, gate, 32, 8192)
    inv = check_batch_invariance(session, gate, alone, 32, 8192)
    print(path.split("/")[-1], f"differing {inv.differing} of {inv.prompts}, logits max|d| {inv.max_abs_diff:.3g}, min cos {inv.min_cosine:.8f}, {time.time()-t:.0f}s", flush=True)
