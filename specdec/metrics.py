"""Prometheus metrics of both services. Names follow vLLM's spec-decode counters where they
overlap (num_drafts, num_draft_tokens, num_accepted_tokens, per position)."""
from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)  # a Session is timed whole: minutes
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)  # a CPU's prefill, a saturated queue

# both services
REQUEST_LATENCY = Histogram("specdec_request_latency_seconds", "Request latency (first byte in to last token out)", ["service", "method"], buckets=_LAT)
REQUEST_ERRORS = Counter("specdec_request_errors_total", "Requests that ended with an error, by gRPC status code (the HTTP front "
                         "door's errors as the status they stand for)", ["service", "method", "code"])
GENERATED_TOKENS = Counter("specdec_generated_tokens_total", "Tokens returned to callers", ["service"])
HTTP_REQUESTS = Counter("specdec_http_requests_total", "HTTP requests to the draft's OpenAI-compatible API by path and status "
                        "(499: the client went away)", ["path", "status"])
LIVE_SESSIONS = Gauge("specdec_live_sessions", "Live generation sessions", ["service"])

# verify side
CACHED_TOKENS = Gauge("specdec_cached_tokens", "Tokens held in target KV caches")
RESERVED_TOKENS = Gauge("specdec_reserved_tokens", "Cache tokens reserved by admitted sessions")
CACHE_BUDGET = Gauge("specdec_cache_budget_tokens", "Cache tokens the verify service admits sessions into (--max-cached-tokens, "
                     "or its share of the memory free at start-up)")
BATCH_SIZE = Histogram("specdec_verify_batch_size", "Sessions per target forward pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))  # --max-sessions may pass 64
BATCH_TOKENS = Histogram("specdec_verify_batch_tokens", "Tokens per target forward pass", buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))  # a GPU pass: 8192 prompt rows + 1024 of rounds
QUEUE_WAIT = Histogram("specdec_verify_queue_wait_seconds", "Time a job waited for the target", buckets=_FAST)
FORWARD_TIME = Histogram("specdec_verify_forward_seconds", "Time of one target forward pass (+ acceptance)", buckets=_FAST)
PASS_UTILISATION = Gauge("specdec_verify_pass_utilisation", "Share of recent wall time the verifier spent in passes")
PASS_FAULTS = Counter("specdec_verify_pass_faults_total", "Verify passes that faulted: nothing in them succeeded and something "
                      "failed other than by a refusal (a device error, a bug)")
VERIFY_BROKEN = Gauge("specdec_verify_broken", "1 while the verify service reports NOT_SERVING because its passes keep faulting, or one does not return")
ROW_PRICE = Gauge("specdec_verify_row_price", "Expected tokens of goodput one more proposal row costs the verifier now")
CAPACITY_REJECTIONS = Counter("specdec_capacity_rejections_total", "Sessions refused with RESOURCE_EXHAUSTED", ["reason"])

# draft side
DRAFT_FALLBACK = Counter("specdec_draft_fallback_sessions_total", "Sessions that stopped drafting with the model and fell back to "
                         "target-only rounds because its measured acceptance made speculation slower", ["model"])
PROPOSALS_PER_ROUND = Histogram("specdec_draft_proposals_per_round", "Proposals sent per verify round (the tau chosen; 0 = a target-only round)",
                                buckets=(0, 1, 2, 4, 8, 16, 32, 64))  # a tree round: up to MAX_ROUND_TOKENS nodes
DRAFT_BATCH_SIZE = Histogram("specdec_draft_batch_size", "Sessions per draft forward pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128))  # up to stepbatch.MAX_BATCH
PACE_COMPARISONS = Counter("specdec_draft_pace_comparisons_total", "The pace's comparisons of speculation with target-only runs, by the "
                           "verifier's open sessions (a power-of-two range) and outcome (lost: sessions hold target-only there; won; "
                           "unconfirmed: a win after a loss, or a lone session's loss after a win, which the next window decides)",
                           ["load", "outcome"])

# draft side (vLLM names)
NUM_DRAFTS = Counter("specdec_spec_decode_num_drafts_total", "Verify rounds, target-only ones (tau 0, a run's steps) included")
NUM_DRAFT_TOKENS = Counter("specdec_spec_decode_num_draft_tokens_total", "Draft tokens proposed")
NUM_ACCEPTED = Counter("specdec_spec_decode_num_accepted_tokens_total", "Draft tokens accepted")
ACCEPTED_PER_POS = Counter("specdec_spec_decode_num_accepted_tokens_per_pos_total", "Accepted draft tokens by position", ["position"])


VERIFY_ONLY = (CACHED_TOKENS, RESERVED_TOKENS, CACHE_BUDGET, BATCH_SIZE, BATCH_TOKENS, QUEUE_WAIT, FORWARD_TIME, PASS_UTILISATION,
               PASS_FAULTS, VERIFY_BROKEN, ROW_PRICE)
DRAFT_ONLY = (HTTP_REQUESTS, DRAFT_FALLBACK, PROPOSALS_PER_ROUND, DRAFT_BATCH_SIZE, PACE_COMPARISONS, NUM_DRAFTS, NUM_DRAFT_TOKENS,
              NUM_ACCEPTED, ACCEPTED_PER_POS)


def serve_metrics(port: int | None, host: str = "0.0.0.0", service: str | None = None) -> int | None:
    """Starts the /metrics HTTP endpoint; port 0 picks a free port. Returns the bound port. With
    `service` ("verify" or "draft"), the other service's metrics are not exported (each process
    showed them all, the other's as constant zeros beside its own)."""
    if port is None:
        return None
    for c in {"verify": DRAFT_ONLY, "draft": VERIFY_ONLY}.get(service, ()):
        try:
            REGISTRY.unregister(c)  # still counts where some code touches it; only not exported
        except KeyError:  # already
            pass
    server, _ = start_http_server(port, addr=host.strip("[]"))  # an IPv6 host as --host takes it, [::] or ::
    return server.server_address[1]
