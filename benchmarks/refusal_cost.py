"""Event-loop cost of one 503 (queue full): 5,000 /predict requests of 8 texts through the real
ASGI app (Gate, routes, data plane), in-process, no network, the model's queue held full.

    PYTHONPATH=src python benchmarks/refusal_cost.py ARTIFACT LABEL
"""
import asyncio, json, sys, time
from modelkiln.serve.settings import ServeSettings, parse_model_arg
from modelkiln.serve.metrics import Metrics
from modelkiln.serve.model import ServedModel
from modelkiln.serve import app as app_module
from modelkiln.serve.dataplane import DataPlane

settings = ServeSettings(warmup=False).with_models((parse_model_arg(f"m={sys.argv[1]}", None),))
metrics = Metrics()
model = ServedModel(settings.models[0], settings, metrics)
model.load()
try:
    plane = DataPlane({"m": model}, settings, metrics)
except TypeError:
    plane = DataPlane({"m": model}, settings)
app = app_module.create_app(plane, metrics)
model.batcher._queued = settings.max_queue_size  # full
body = json.dumps({"inputs": [f"sentence number {i} of a request" for i in range(8)]}).encode()
scope = {"type": "http", "method": "POST", "path": "/v2/models/m/predict", "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
statuses = []
async def receive():
    return {"type": "http.request", "body": body, "more_body": False}
async def send(message):
    if message["type"] == "http.response.start":
        statuses.append(message["status"])
async def main():
    for _ in range(500):
        await app(dict(scope), receive, send)
    n = 5000
    t = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t) / n
import logging; logging.basicConfig(stream=open("/dev/null", "w"), level=logging.INFO)
per = asyncio.run(main())
print(f"{sys.argv[2]}: {per*1e6:.1f} us per 503, statuses {set(statuses)}")
model.batcher._queued = 0
model.stop()
