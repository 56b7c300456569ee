"""Prometheus metrics, in a registry of their own (so tests and embedding apps don't collide).

With ``kiln serve --workers N`` every worker process writes its values to files in one folder
(prometheus_client's multiprocess mode, switched on by ``MULTIPROCESS_DIR`` in the environment
before prometheus_client is first imported: ``serve/workers.py`` sets it for the workers it
starts), and ``/metrics``, whichever worker answers it, reads them all: counters and histograms
add up over every worker that ever ran (a replaced worker's requests still count), gauges add up
over the live ones."""

from __future__ import annotations

import os
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # ``status``: the HTTP status, or the gRPC status code's name; ``protocol``: http or grpc.
        self.requests = Counter("kiln_requests_total", "Requests answered, by route, outcome and protocol.",
                                ["model", "route", "status", "protocol"], registry=r)
        self.request_seconds = Histogram("kiln_request_duration_seconds", "Time from request to answer.",
                                         ["model", "route", "protocol"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("kiln_queue_duration_seconds", "Time an input waited before its batch ran.",
                                       ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("kiln_batch_compute_seconds", "Model execution + postprocessing per batch.",
                                         ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kiln_batch_size", "Inputs per model batch.", ["model"],
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("kiln_batch_tokens", "Padded tokens per model batch.", ["model"],
                                      buckets=_TOKEN_BUCKETS, registry=r)
        live: Literal["livesum"] = "livesum"  # several workers: the sum over the live ones
        self.in_flight = Gauge("kiln_requests_in_flight", "Requests being handled now.", registry=r,
                               multiprocess_mode=live)
        self.queued = Gauge("kiln_queue_inputs", "Inputs waiting for a batch.", ["model"], registry=r,
                            multiprocess_mode=live)
        # What each loaded model runs, as Prometheus' info pattern: which hosts of a fleet really multiply on AMX,
        # which fell back (a refused KILN_AMX=1 says why in the load log). A load adds 1 and its release takes it
        # away (0 once unloaded): a reload loads the new model before it releases the old, under the same labels.
        self.model_info = Gauge("kiln_model_info", "A loaded model: its task, variant and the matrix engine its "
                                "products run on (1 while loaded).", ["model", "task", "variant", "matrix_engine"],
                                registry=r, multiprocess_mode="livemax")
        # kiln ray's router, when a replica is lost under a request (ray/failover.py)
        self.retries = Counter("kiln_retries_total", "Requests sent again to another replica after theirs was "
                               "lost before answering (encoder requests; generation before its first token).",
                               ["model"], registry=r)
        self.streams_resumed = Counter("kiln_streams_resumed_total", "Streamed answers continued on another "
                                       "replica after theirs was lost mid-answer.", ["model"], registry=r)
        self.failovers_failed = Counter("kiln_failovers_failed_total", "Requests whose replica was lost and that "
                                        "found no other in time (answered 503 or an SSE error).", ["model"],
                                        registry=r)
        # Text generation, under vLLM's names (its dashboards and alerts work unchanged), label model_name.
        g = ["model_name"]
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", g,
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens.", g,
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds", "Generation request latency.", g,
                                     buckets=_LATENCY_BUCKETS + (60.0, 120.0, 300.0), registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled.", g, registry=r)
        # vLLM's prefix-cache counters: hit rate = hits / queries
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                            g, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens restored from the prefix cache.",
                                         g, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", g, registry=r)
        # vLLM's speculative-decoding counters (--speculate): acceptance = accepted tokens / draft tokens
        self.spec_decode_drafts = Counter("vllm:spec_decode_num_drafts", "Verify calls with drafted tokens.", g,
                                          registry=r)
        self.spec_decode_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", g, registry=r)
        self.spec_decode_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                                   "Drafted tokens accepted (each the token plain decoding chose).", g,
                                                   registry=r)
        self.requests_running = Gauge("vllm:num_requests_running", "Sequences being prefilled or generating.", g,
                                      registry=r, multiprocess_mode=live)
        self.requests_waiting = Gauge("vllm:num_requests_waiting", "Generation requests waiting.", g, registry=r,
                                      multiprocess_mode=live)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache in use, as a fraction of --max-kv-tokens "
                                    "(1 = full).", g, registry=r, multiprocess_mode=live)

    def render(self) -> tuple[bytes, str]:
        folder = os.environ.get(MULTIPROCESS_DIR)
        if not folder:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client.multiprocess import MultiProcessCollector

        every_worker = CollectorRegistry()
        MultiProcessCollector(every_worker, folder)
        return generate_latest(every_worker), CONTENT_TYPE_LATEST
