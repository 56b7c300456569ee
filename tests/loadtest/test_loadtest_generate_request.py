"""The body `kiln loadtest --protocol generate` sends: Triton's decoupled generation models (the
repository `kiln triton` writes, Triton's vLLM backend) stream one event per token only when the
request says ``"stream": true``; without it the whole answer came back as one event and the load
test counted one token per answer (seen against `kiln triton` on tritonserver)."""

import json

from modelkiln.loadtest.streaming import GenerationRequest


def test_generate_asks_triton_to_stream():
    request = GenerationRequest("generate", "smollm2", max_tokens=32, ignore_eos=True).build("Hello")
    body = json.loads(request.body)
    assert request.path == "/v2/models/smollm2/generate_stream"
    assert body == {"text_input": "Hello",
                    "parameters": {"temperature": 0, "max_tokens": 32, "ignore_eos": True, "stream": True}}


def test_openai_bodies_stream_at_the_top_level():
    body = json.loads(GenerationRequest("openai-chat", "smollm2", max_tokens=8).build("Hi").body)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "parameters" not in body
