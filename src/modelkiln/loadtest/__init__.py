"""``kiln loadtest``: measure any Open Inference Protocol server (kiln serve, Triton, MLServer).

Modules: ``inputs`` (real text), ``protocols`` (request bodies), ``client`` (a minimal HTTP/1.1
keep-alive client), ``runner`` (closed/open loops, windows, stability), ``server_metrics``
(Prometheus scrapes), ``report`` (table/CSV/JSON), ``plot`` (latency vs throughput)."""
