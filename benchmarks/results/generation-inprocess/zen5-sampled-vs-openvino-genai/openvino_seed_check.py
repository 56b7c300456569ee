"""Are OpenVINO GenAI's seeded draws the same alone and in a batch? Run in its environment:
    OV_VENV/bin/python openvino_seed_check.py sampled/spec-openvino-genai.json
(the spec holds the export's folder and the prompts' token ids)."""
import json, sys, numpy as np, openvino as ov, openvino_genai as ovg
spec = json.load(open(sys.argv[1]))
s = ovg.SchedulerConfig(); s.enable_prefix_caching = True; s.max_num_batched_tokens = 256; s.max_num_seqs = 16; s.cache_size = 1
pipe = ovg.ContinuousBatchingPipeline(spec["ov_model"], s, "CPU", {"INFERENCE_NUM_THREADS": 2})
def cfg(seed):
    c = ovg.GenerationConfig(); c.max_new_tokens = 32; c.ignore_eos = True; c.do_sample = True
    c.temperature, c.top_p, c.rng_seed = 0.7, 0.95, seed; return c
n = iter(range(10**6))
def run(prompts, seeds):
    hs = [pipe.add_request(next(n), ov.Tensor(np.asarray([p], dtype="int64")), cfg(sd)) for p, sd in zip(prompts, seeds)]
    toks = [[] for _ in prompts]
    while pipe.has_non_finished_requests():
        pipe.step()
        for i, h in enumerate(hs):
            if h.can_read():
                for o in h.read().values(): toks[i].extend(o.generated_ids)
    return toks
P = spec["prompts"]
a = run([P[0]], [0]); b = run([P[0]], [0]); c = run([P[0], P[0]], [0, 0]); d = run(P[:8], list(range(8)))
print("alone twice same:", a == b)
print("two copies same seed, same as alone:", c[0] == a[0], c[1] == a[0])
print("in 8 (seed 0):", d[0] == a[0])
# greedy-with-sampling-off sanity: same prompt alone vs in 8 greedy
def first_diff(x, y): return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
print("c0 vs c1:", first_diff(c[0], c[1]), "c0 vs a:", first_diff(c[0], a[0]), "c1 vs a:", first_diff(c[1], a[0]), "d0 vs a:", first_diff(d[0], a[0]))
