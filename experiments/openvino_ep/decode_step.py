"""One decode step of the kiln serving graph (SmolLM2 int4) at 16 rows with a 128-token past:
onnxruntime's CPU EP against its OpenVINO EP (onnxruntime-openvino), 2 threads, median of 30 calls.
Run: python experiments/openvino_ep/decode_step.py artifacts/smollm2/model.int4.onnx CPUExecutionProvider
(and, in a venv with onnxruntime-openvino, OpenVINOExecutionProvider)."""
import sys, time, numpy as np, onnxruntime as ort
path, provider = sys.argv[1], sys.argv[2]
rows, past, cap = 16, 128, 256
so = ort.SessionOptions(); so.intra_op_num_threads = 2
opts = [{"num_of_threads": "2"}] if provider.startswith("OpenVINO") else None
t = time.perf_counter()
sess = ort.InferenceSession(path, so, providers=[provider], provider_options=opts)
print(provider, "load s", round(time.perf_counter() - t, 1), sess.get_providers())
feeds = {"input_ids": np.full((rows, 1), 42, np.int64), "seqlens_k": np.full((rows,), past, np.int32),
         "total_sequence_length": np.array(past + 1, np.int32), "logit_positions": np.arange(rows, dtype=np.int64)}
rng = np.random.default_rng(0)
for i in range(30):
    for kv in ("key", "value"):
        feeds[f"past_key_values.{i}.{kv}"] = (rng.standard_normal((rows, 3, cap, 64)) * 0.1).astype(np.float32)
times = []
for _ in range(30):
    t = time.perf_counter(); out = sess.run(["logits"], feeds); times.append(time.perf_counter() - t)
print(provider, "16-row decode step ms median", round(1000 * np.median(times[5:]), 1), "logits[0,:3]", out[0][0, :3])
