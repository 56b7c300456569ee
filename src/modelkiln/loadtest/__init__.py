"""``kiln loadtest``: measure any Open Inference Protocol server (kiln serve, Triton, MLServer),
and text-generation servers over OpenAI's and Triton's streaming routes (vLLM, llama.cpp, TGI...).

Modules: ``inputs`` (real text), ``protocols`` (request bodies), ``client`` (a minimal HTTP/1.1
keep-alive client), ``streaming`` (generation: streamed requests, per-token timing), ``runner``
(closed/open loops, windows, stability), ``check`` (``--check``: every answer against its
reference), ``server_metrics`` (Prometheus scrapes), ``report`` (table/CSV/JSON), ``plot``
(latency vs throughput)."""
