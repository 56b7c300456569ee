"""In-process latency and throughput of every backend and variant."""
