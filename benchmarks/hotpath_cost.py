"""Event-loop cost of one answered /infer request (JSON, 1 text) through the real ASGI app, the
model's run replaced by a stored answer: the edge + data plane overhead alone (5,000 requests).

    PYTHONPATH=src python benchmarks/hotpath_cost.py ARTIFACT LABEL
"""
import asyncio, json, sys, time
import numpy as np
from modelkiln.serve.settings import ServeSettings, parse_model_arg
from modelkiln.serve.metrics import Metrics
from modelkiln.serve.model import ServedModel
from modelkiln.serve import app as app_module
from modelkiln.serve.dataplane import DataPlane

settings = ServeSettings(warmup=False).with_models((parse_model_arg(f"m={sys.argv[1]}", None),))
metrics = Metrics()
model = ServedModel(settings.models[0], settings, metrics)
model.load()
vector = np.random.rand(384).astype(np.float32)
async def run(inputs, timeout_s):
    return [vector for _ in inputs], 7
model.run = run
try:
    plane = DataPlane({"m": model}, settings, metrics)
except TypeError:
    plane = DataPlane({"m": model}, settings)
app = app_module.create_app(plane, metrics)
body = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["A man is playing a guitar."]}]}).encode()
scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
statuses = []
class Cycle:
    disconnected = False
    async def receive(self):
        return {"type": "http.request", "body": body, "more_body": False}
cycle = Cycle()
async def send(message):
    if message["type"] == "http.response.start":
        statuses.append(message["status"])
async def main():
    for _ in range(500):
        await app(dict(scope), cycle.receive, send)
    n = 5000
    t = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), cycle.receive, send)
    return (time.perf_counter() - t) / n
import uvloop; uvloop.install()
per = asyncio.run(main())
print(f"{sys.argv[2]}: {per*1e6:.1f} us per answered request, statuses {set(statuses)}")
model.stop()
