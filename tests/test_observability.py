"""Observability (issue 7, point 4): the real /metrics endpoints move exactly as a known set of
requests says they should (checked against the per-request stats the client gets back), and each
request leaves one JSON log line on each hop carrying the same request id."""
import json

import grpc
import pytest

from bench.launch import ENV, Service, service_pair, start_pair
from client import Client, make_request
from helpers import json_log_lines, metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def pair(model_dir):
    with service_pair(model_dir("target"), model_dir("draft"), "--log-level", "INFO") as p:
        yield p


DRAFT_COUNTERS = ["specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
                  "specdec_spec_decode_num_accepted_tokens_total"]


def snapshot(v: Service, d: Service, tau: int) -> dict:
    dt, vt = d.metrics(), v.metrics()
    s = {name: metric(dt, name) for name in DRAFT_COUNTERS}
    for i in range(tau):
        s[f"pos{i}"] = metric(dt, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
    s["draft_latency_count"] = metric(dt, "specdec_request_latency_seconds_count", service="draft", method="Generate")
    s["draft_errors_invalid"] = metric(dt, "specdec_request_errors_total", service="draft", method="Generate", code="INVALID_ARGUMENT")
    s["draft_generated"] = metric(dt, "specdec_generated_tokens_total", service="draft")
    s["draft_live"] = metric(dt, "specdec_live_sessions", service="draft")
    s["verify_latency_count"] = metric(vt, "specdec_request_latency_seconds_count", service="verify", method="Generate")
    s["verify_session_latency_count"] = metric(vt, "specdec_request_latency_seconds_count", service="verify", method="Session")
    s["verify_errors_invalid"] = metric(vt, "specdec_request_errors_total", service="verify", method="Generate", code="INVALID_ARGUMENT")
    s["verify_session_errors_invalid"] = metric(vt, "specdec_request_errors_total", service="verify", method="Session", code="INVALID_ARGUMENT")
    s["verify_generated"] = metric(vt, "specdec_generated_tokens_total", service="verify")
    s["verify_live"] = metric(vt, "specdec_live_sessions", service="verify")
    s["verify_reserved"] = metric(vt, "specdec_reserved_tokens")
    s["verify_cached"] = metric(vt, "specdec_cached_tokens")
    s["verify_batches"] = metric(vt, "specdec_verify_batch_size_count")
    return s


def test_metrics_move_exactly_with_a_known_set_of_requests(pair):
    v, d = pair
    tau = 3
    before = snapshot(v, d, tau)
    spec = []
    with Client(d.address, timeout=60) as c:
        for i, kw in enumerate([dict(), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_k=5, seed=2, proposal_mode="dense"),
                                dict(temperature=1.0, seed=3, proposal_mode="greedy")]):
            spec.append(c.generate(make_request(prompt_ids=[3, 4 + i], max_new_tokens=12, num_draft_tokens=tau, request_id=f"obs-{i}", **kw)))
        for bad in (dict(prompt=""), dict(prompt="w3", top_p=2.0)):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(**bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(v.address, target_only=True, timeout=60) as c:
        base = c.generate(prompt_ids=[3, 4], max_new_tokens=7, request_id="obs-target")
        with pytest.raises(grpc.RpcError):
            c.generate(prompt_ids=[3, 99])
    after = snapshot(v, d, tau)
    delta = {k: after[k] - before[k] for k in before}

    assert delta["specdec_spec_decode_num_drafts_total"] == sum(r.stats["rounds"] for r in spec)
    assert delta["specdec_spec_decode_num_draft_tokens_total"] == sum(r.stats["drafted"] for r in spec)
    assert delta["specdec_spec_decode_num_accepted_tokens_total"] == sum(r.stats["accepted"] for r in spec)
    for i in range(tau):
        assert delta[f"pos{i}"] == sum(r.stats["accepted_per_position"][i] for r in spec), i
    assert delta["draft_latency_count"] == len(spec) + 2  # failed requests are timed too
    assert delta["draft_errors_invalid"] == 2
    assert delta["draft_generated"] == sum(len(r.token_ids) for r in spec)
    assert delta["verify_latency_count"] == 2
    # one session per speculative request, timed by the verify's request observer (which may end just after the reply)
    assert wait_for(lambda: snapshot(v, d, tau)["verify_session_latency_count"] - before["verify_session_latency_count"] == len(spec), 5)
    assert delta["verify_errors_invalid"] == 1
    assert delta["verify_session_errors_invalid"] == 0  # bad requests stop at the draft's edge
    assert delta["verify_generated"] == len(base.token_ids) >= 1
    assert delta["verify_batches"] >= sum(r.stats["rounds"] for r in spec) / 4  # rounds are batched, each in some pass
    # nothing left behind
    assert after["draft_live"] == 0
    assert wait_for(lambda: snapshot(v, d, tau)["verify_live"] == 0, 5)
    s = snapshot(v, d, tau)
    assert s["verify_reserved"] == 0 and s["verify_cached"] == 0
    # the numbers are consistent with themselves
    assert sum(r.stats["accepted"] for r in spec) <= sum(r.stats["drafted"] for r in spec)


def test_live_sessions_gauge_counts_running_streams(model_dir, pair):
    v, d = pair
    with Client(d.address, timeout=60) as c:
        it = c.stream(prompt_ids=[3], max_new_tokens=60, num_draft_tokens=1, temperature=1.0, seed=4)
        next(it)
        dt, vt = d.metrics(), v.metrics()
        running = metric(dt, "specdec_live_sessions", service="draft"), metric(vt, "specdec_live_sessions", service="verify")
        it.close()
    assert running == (1, 1)  # a seeded request of 60 one-token rounds: running still (it does not end early)
    assert wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
    assert metric(d.metrics(), "specdec_live_sessions", service="draft") == 0


def test_request_id_on_both_hops(pair):
    v, d = pair
    with Client(d.address, timeout=60) as c:
        named = c.generate(prompt="w3 w4", max_new_tokens=9, num_draft_tokens=2, request_id="trace-me-123")
        anon = c.generate(prompt="w5 w6", max_new_tokens=9, temperature=1.0, seed=9)
        with pytest.raises(grpc.RpcError):
            c.generate(prompt_ids=[3], max_new_tokens=0, request_id="bad-one")
    assert named.request_id == "trace-me-123"
    assert len(anon.request_id) == 32  # made by the draft service, returned to the caller
    for r in (named, anon):
        assert wait_for(lambda r=r: json_log_lines(v, msg="session done", request_id=r.request_id), 5), v.stderr[-5:]
        assert wait_for(lambda r=r: json_log_lines(d, msg="request done", request_id=r.request_id), 5), d.stderr[-5:]
        (dl,) = json_log_lines(d, msg="request done", request_id=r.request_id)
        (vl,) = json_log_lines(v, msg="session done", request_id=r.request_id)
        assert dl["code"] == "OK" and dl["service"] == "draft" and dl["tokens"] == len(r.token_ids)
        assert dl["rounds"] == vl["rounds"] == r.stats["rounds"]
        assert dl["finish_reason"] == vl["finish_reason"] == r.finish_reason
        assert vl["service"] == "verify" and vl["tokens"] == len(r.token_ids) and vl["prompt_tokens"] == r.stats["prompt_tokens"]
        for line in (dl, vl):
            assert line["level"] == "info" and line["ts"].endswith("Z") and line["duration_s"] >= 0
    assert wait_for(lambda: json_log_lines(d, msg="request done", request_id="bad-one"), 5), d.stderr[-5:]
    (bad,) = json_log_lines(d, msg="request done", request_id="bad-one")
    assert bad["code"] == "INVALID_ARGUMENT" and "max_new_tokens" in bad["error"]
    assert not json_log_lines(v, msg="session done", request_id="bad-one")  # never reached the verify
    # target-only requests are logged by the verify service too
    with Client(v.address, target_only=True, timeout=60) as c:
        c.generate(prompt_ids=[3], max_new_tokens=3, request_id="direct-1")
    assert wait_for(lambda: json_log_lines(v, msg="request done", request_id="direct-1"), 5), v.stderr[-5:]
    (t,) = json_log_lines(v, msg="request done", request_id="direct-1")
    assert t["code"] == "OK" and t["tokens"] == 3 and t["finish_reason"] == "length"
    # a header and a field that disagree: the verify's response and its logs take the header, as the draft's do (they
    # took the field, while the request observer logged the header)
    with grpc.insecure_channel(v.address) as ch:
        chunks = list(pb_grpc.VerifyStub(ch).Generate(pb.GenerateRequest(prompt_ids=[3], max_new_tokens=2, request_id="field-2"),
                                                      metadata=[("x-request-id", "header-2")], timeout=60))
    assert chunks[0].request_id == "header-2"
    assert wait_for(lambda: json_log_lines(v, msg="request done", request_id="header-2"), 5), v.stderr[-5:]
    assert not json_log_lines(v, msg="request done", request_id="field-2")


def test_opentelemetry_spans_link_both_hops(model_dir):
    """--trace console (here through SPECDEC_TRACE): one span per request on each hop, the
    verify's Session span a child of the draft's Generate span (W3C traceparent metadata)."""
    pytest.importorskip("opentelemetry.sdk")
    env = dict(ENV, SPECDEC_TRACE="console")
    v, d = start_pair(("--model", model_dir("target")), ("--model", model_dir("draft"), "--http-port", "0"), env=env)
    try:
        with Client(d.address, timeout=60) as c:
            r = c.generate(prompt="w3 w4", max_new_tokens=6, request_id="traced-1")
        # from a review: the HTTP door opened no span, its verify Session span was a root, and a caller's traceparent was dropped
        import urllib.request

        trace_id = "0af7651916cd43dd8448eb211c80319c"
        model = json.loads(urllib.request.urlopen(f"http://{d.http_address}/v1/models", timeout=60).read())["data"][0]["id"]
        req = urllib.request.Request(f"http://{d.http_address}/v1/completions", method="POST",
                                     data=json.dumps({"model": model, "prompt": "w3", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": "traced-http",
                                              "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
        assert urllib.request.urlopen(req, timeout=60).status == 200

        def spans(svc, name):
            return [s for s in json_log_lines(svc, name=name) if s.get("attributes", {}).get("specdec.request_id") == "traced-1"]

        assert wait_for(lambda: spans(d, "specdec.draft/Generate") and spans(v, "specdec.verify/Session"), 10), (d.stderr[-3:], v.stderr[-3:])
        (ds,), (vs,) = spans(d, "specdec.draft/Generate"), spans(v, "specdec.verify/Session")
        assert vs["context"]["trace_id"] == ds["context"]["trace_id"]
        assert vs["parent_id"] == ds["context"]["span_id"]
        assert ds["attributes"]["specdec.code"] == "OK" and ds["attributes"]["specdec.tokens"] == len(r.token_ids)
        assert vs["attributes"]["specdec.rounds"] == r.stats["rounds"]
        assert ds["resource"]["attributes"]["service.name"] == "specdec.v1.Draft"
        assert vs["resource"]["attributes"]["service.name"] == "specdec.v1.Verify"
        def http_spans(svc, prefix):
            return [s for s in json_log_lines(svc) if s.get("name", "").startswith(prefix)
                    and s.get("attributes", {}).get("specdec.request_id") == "traced-http"]

        assert wait_for(lambda: http_spans(d, "specdec.draft/POST") and http_spans(v, "specdec.verify/Session"), 10), d.stderr[-3:]
        (hs,), (hv,) = http_spans(d, "specdec.draft/POST"), http_spans(v, "specdec.verify/Session")
        assert hs["context"]["trace_id"] == hv["context"]["trace_id"] == "0x" + trace_id and hv["parent_id"] == hs["context"]["span_id"]
        assert hs["attributes"]["specdec.http_status"] == 200
        # the draft's Info polls (every 2 s, and its start-up's) are no trace's root: one span per poll made noise
        assert not json_log_lines(v, name="specdec.verify/Info"), json_log_lines(v, name="specdec.verify/Info")[:1]
    finally:
        d.stop()
        v.stop()


def test_the_serving_line_says_how_long_the_start_up_took(model_dir):
    """`serving` carries startup_s, the process's age when it began to serve: the imports and the
    engine's load-time choices, which a restart (or a pod's readiness) waits for."""
    import time

    t0 = time.monotonic()
    v = Service("verify_service", "--model", model_dir("target"), "--log-level", "INFO",
                env=dict(ENV, SPECDEC_FORKSERVER="0"))  # its own command line: the imports are part of its age
    waited = time.monotonic() - t0  # from before the process existed to its `listening on` line
    try:
        assert wait_for(lambda: json_log_lines(v, msg="serving"), 5), v.stderr[-3:]
        (line,) = json_log_lines(v, msg="serving")
        assert 0 < line["startup_s"] <= waited + 0.5, (line, waited)  # the process's age: less than it took to start it
    finally:
        v.stop()


def test_a_bad_request_id_field_is_refused_and_never_logged(pair):
    """A GenerateRequest.request_id (or SessionStart.request_id) that is not a valid id is refused
    by validation, and the request's log line carries a fresh id and the bad one's length, never
    the value itself (it was logged whole, before the caller's token was checked: 100 KB of it,
    newlines included)."""
    v, d = pair
    rid = "EVIL\n" + "x" * 20_000
    bad = '"bad_request_id_chars": 20005'
    for svc, stub in ((d, pb_grpc.DraftStub), (v, pb_grpc.VerifyStub)):
        with grpc.insecure_channel(svc.address) as ch, pytest.raises(grpc.RpcError) as e:
            list(stub(ch).Generate(pb.GenerateRequest(prompt_ids=[3, 4], max_new_tokens=4, request_id=rid), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
        assert wait_for(lambda: any(bad in line and "request done" in line for line in svc.stderr), 10), svc.stderr[-3:]
    with grpc.insecure_channel(v.address) as ch:
        fp = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=60).vocab_fingerprint
        start = pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=4, vocab_fingerprint=fp, request_id=rid)
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.VerifyStub(ch).Session(iter([pb.VerifyRequest(start=start)]), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: sum(bad in line for line in v.stderr) >= 2, 10), v.stderr[-3:]
    assert not any("x" * 1000 in line for line in d.stderr + v.stderr)


def test_a_call_whose_caller_left_is_logged_cancelled_even_when_its_handler_returned_quietly():
    """serving.fail returns without a status when the caller is gone (no one to tell of a failed
    write); the observer then names the call CANCELLED, not OK, and counts no error."""
    from specdec.observe import code_name

    import time

    class Context:  # the questions code_name asks of a grpc.aio.ServicerContext
        def __init__(self, cancelled, code=None, remaining=None):
            self._cancelled, self._code, self._remaining = cancelled, code, remaining

        def cancelled(self):
            return self._cancelled

        def code(self):
            return self._code

        def time_remaining(self):
            return self._remaining

    assert code_name(Context(True), None) == "CANCELLED"
    assert code_name(Context(True, remaining=5.0), None) == "CANCELLED"  # a deadline not reached: the caller left
    assert code_name(Context(False), None) == "OK"
    assert code_name(Context(False), RuntimeError()) == "UNKNOWN"
    assert code_name(Context(False, grpc.StatusCode.INTERNAL), RuntimeError()) == "INTERNAL"
    # from a review: a deadline past, or the drain's cut at the end of its grace, were logged CANCELLED and never counted
    assert code_name(Context(True, remaining=0.0), None) == "DEADLINE_EXCEEDED"
    assert code_name(Context(True), None, cut_at=time.monotonic()) == "UNAVAILABLE"
    assert code_name(Context(True), None, cut_at=time.monotonic() + 30) == "CANCELLED"  # left during the grace: its own choice


def test_a_call_past_its_deadline_is_counted_deadline_exceeded(services):
    """Through real services: a Generate whose deadline passes mid-stream is DEADLINE_EXCEEDED in
    both services' error counters (it was CANCELLED, which the error-rate alert leaves out)."""
    v, d = services("long-target", "long-draft")
    before = {s: metric(s.metrics(), "specdec_request_errors_total", code="DEADLINE_EXCEEDED") for s in (v, d)}
    for svc, stub in ((v, pb_grpc.VerifyStub), (d, pb_grpc.DraftStub)):
        with grpc.insecure_channel(svc.address) as ch:
            with pytest.raises(grpc.RpcError) as e:  # 3,000 tokens: the deadline passes while the service still generates
                list(stub(ch).Generate(pb.GenerateRequest(prompt_ids=[3, 4], max_new_tokens=3000), timeout=0.3))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: metric(svc.metrics(), "specdec_request_errors_total", code="DEADLINE_EXCEEDED") > before[svc], 10), \
            svc.metrics()[-2000:]


def test_a_session_past_its_deadline_is_counted_deadline_exceeded(services):
    """From a review: a Verify.Session whose deadline passed while its draft sent nothing more
    ended its reads as if the draft had closed them, and was logged and counted OK."""
    import threading

    v, _ = services()
    labels = dict(service="verify", method="Session", code="DEADLINE_EXCEEDED")
    before = metric(v.metrics(), "specdec_request_errors_total", **labels)
    gone = threading.Event()

    def requests(start):
        yield start
        gone.wait(10)  # the stream stays open, silent, past its deadline

    with grpc.insecure_channel(v.address) as ch:
        fp = pb_grpc.VerifyStub(ch).Info(pb.InfoRequest(), timeout=60).vocab_fingerprint
        start = pb.VerifyRequest(start=pb.SessionStart(prompt_ids=[3, 4], max_new_tokens=8, vocab_fingerprint=fp))
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.VerifyStub(ch).Session(requests(start), timeout=1.0))
        gone.set()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: metric(v.metrics(), "specdec_request_errors_total", **labels) == before + 1, 10), v.metrics()[-2000:]


def test_each_service_exports_its_own_metrics_only(services):
    """From a review: each process exported every metric of both services, the other's as
    constant zeros beside its own (a draft pod's specdec_verify_broken 0 on a per-pod panel)."""
    v, d = services()
    with Client(d.address, timeout=60) as c:
        assert c.generate(prompt_ids=[3, 4], max_new_tokens=4).token_ids
    names = {s: {line.split("{")[0].split(" ")[0] for line in s.metrics().splitlines() if line.startswith("specdec_")} for s in (v, d)}
    assert "specdec_verify_broken" in names[v] and "specdec_verify_broken" not in names[d]
    assert "specdec_cache_budget_tokens" in names[v] and "specdec_cache_budget_tokens" not in names[d]
    assert "specdec_spec_decode_num_drafts_total" in names[d] and "specdec_spec_decode_num_drafts_total" not in names[v]
    assert "specdec_http_requests_total" not in names[v]
    for s in (v, d):  # what both export
        assert {"specdec_request_latency_seconds_count", "specdec_live_sessions"} <= names[s], names[s]


def test_the_pass_histograms_reach_their_limits():
    """A histogram whose top bucket is below what it observes puts every large pass in +Inf: its
    quantiles say nothing there. Each size histogram's top bucket reaches its default limit."""
    from draft_service import stepbatch
    from specdec import metrics
    from verify_service import scheduler

    def top(h) -> float:
        return max(float(s.labels["le"]) for s in h.collect()[0].samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")

    assert top(metrics.BATCH_TOKENS) >= scheduler.MAX_BATCH_TOKENS + scheduler.GPU_PREFILL_ROWS  # a GPU pass's prompt rows and rounds
    assert top(metrics.DRAFT_BATCH_SIZE) >= stepbatch.MAX_BATCH
    assert top(metrics.BATCH_SIZE) >= 64  # the verify service's --max-sessions default


def test_text_logs_carry_the_fields_json_lines_do(capsys):
    """--log-format text printed the message alone: the request id, code, tokens and the rest of
    a request's line were lost."""
    import logging

    from specdec import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("text", "INFO")
        logging.getLogger("specdec.draft").info("request done", extra={"fields": {"request_id": "r-1", "code": "OK", "tokens": 3,
                                                                                  "error": "two words"}})
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith('request done code=OK error="two words" request_id=r-1 tokens=3'), line


def test_a_session_the_models_record_skips_is_counted_a_fallback_once_it_runs(model_dir):
    """A session whose draft model the record skips was counted in
    specdec_draft_fallback_sessions_total when its loop was made: before any verify replica took it,
    so every refused placement (a full tier, a client's retries) counted one more."""
    from prometheus_client import REGISTRY

    from draft_service import decode
    from draft_service.decode import DecodeLoop
    from draft_service.drafter import Drafter
    from specdec.costmodel import Costs
    from specdec.lm import LM
    from specdec.sampling import Sampling
    from specdec.validation import GenParams

    lm = LM.load(model_dir("draft"), "cpu", "float32")
    costs = Costs(0.004, 0.010, 0.0)
    g = GenParams(prompt_ids=[3, 4, 5], max_new_tokens=8, sampling=Sampling(temperature=0.0), seed=1, seeded=False, tau=4,
                  proposer=pb.PROPOSER_DRAFT, mode=pb.PROPOSAL_MODE_GREEDY)

    def count():
        return REGISTRY.get_sample_value("specdec_draft_fallback_sessions_total", {"model": lm.name}) or 0.0

    before = count()
    loops = [DecodeLoop(Drafter(lm), g, lm.fingerprint, lm.max_context, costs=costs, fallback=costs, skip=True) for _ in range(3)]
    assert all(loop.skipped and loop.fallen_back for loop in loops) and count() == before  # refused placements: none counted
    loops[0].placed()
    loops[0].placed()
    assert count() == before + 1
    decode.RECORDS.clear()
