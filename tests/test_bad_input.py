"""Bad input gets a clear status and leaves the services healthy (issue 7, point 1).

Table-driven cases against the real processes (Draft.Generate, Verify.Generate, Verify.Session):
each must end with the expected code and a message naming the offending field. Then a
property-based test throws generated garbage at both services: every answer must be a success
or a clean status, never INTERNAL / UNKNOWN, and both services must stay healthy.

Not representable on the wire (so not tested here): negative top_k / max_new_tokens /
num_draft_tokens (the fields are uint32; the protobuf library refuses them in the caller, and
the CLI checks its flags). Oversized messages are refused by gRPC itself with
RESOURCE_EXHAUSTED before any servicer code runs (--max-message-bytes, 16 MiB by default).
"""
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
V, CTX = 16, 64  # the tiny "target"/"draft" pair of conftest.py
TIMEOUT = 30


@pytest.fixture(scope="module")
def svc(services):
    v, d = services("target", "draft")
    chans = [grpc.insecure_channel(a, options=[("grpc.max_send_message_length", 64 << 20)]) for a in (v.address, d.address)]
    info = pb_grpc.VerifyStub(chans[0]).Info(pb.InfoRequest(), timeout=TIMEOUT)
    yield dict(verify=pb_grpc.VerifyStub(chans[0]), draft=pb_grpc.DraftStub(chans[1]), chans=chans, fp=info.vocab_fingerprint)
    for c in chans:
        c.close()


def gen(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    kw.setdefault("max_new_tokens", 4)
    if "prompt" not in kw and "prompt_ids" not in kw:
        kw["prompt_ids"] = [3, 4]
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)


def call_generate(stub, req: pb.GenerateRequest) -> grpc.StatusCode:
    """Runs a Generate to the end; returns its status (raises nothing)."""
    try:
        list(stub.Generate(req, timeout=TIMEOUT))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def session(stub, msgs, timeout=TIMEOUT):
    """Sends msgs on one Session stream; returns (responses, code, details)."""
    out = []
    try:
        for r in stub.Session(iter(msgs), timeout=timeout):
            out.append(r)
        return out, grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return out, e.code(), e.details()


def assert_healthy(svc):
    for ch in svc["chans"]:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    for stub in (svc["draft"], svc["verify"]):
        chunks = list(stub.Generate(gen(prompt="w3 w4", max_new_tokens=3), timeout=TIMEOUT))
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


# ---- client-facing Generate (both services) ---------------------------------------------------

GENERATE_CASES = [
    ("empty prompt", gen(prompt=""), "prompt"),
    ("whitespace prompt", gen(prompt="   "), "prompt"),
    ("prompt and prompt_ids", gen(prompt="w3", prompt_ids=[3]), "prompt"),
    ("prompt fills the context", gen(prompt_ids=[3] * CTX), "prompt"),
    ("prompt text longer than the context", gen(prompt=" ".join(["w3"] * 200)), "prompt"),
    ("prompt id above vocab", gen(prompt_ids=[3, V]), "prompt_ids"),
    ("negative prompt id", gen(prompt_ids=[-1, 3]), "prompt_ids"),
    ("max_new_tokens 0", gen(max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens absurd", gen(max_new_tokens=2**32 - 1), "max_new_tokens"),
    ("temperature negative", gen(sampling=dict(temperature=-1.0)), "temperature"),
    ("temperature NaN", gen(sampling=dict(temperature=math.nan)), "temperature"),
    ("temperature inf", gen(sampling=dict(temperature=math.inf)), "temperature"),
    ("temperature denormal", gen(sampling=dict(temperature=1e-40)), "temperature"),
    ("top_p above 1", gen(sampling=dict(temperature=1.0, top_p=1.5)), "top_p"),
    ("top_p negative", gen(sampling=dict(temperature=1.0, top_p=-0.1)), "top_p"),
    ("top_p NaN", gen(sampling=dict(temperature=1.0, top_p=math.nan)), "top_p"),
    ("tau above its range", gen(num_draft_tokens=33), "num_draft_tokens"),
    ("tree budget above the limit", gen(tree_budget=65), "tree_budget"),
    ("unknown proposal mode", gen(proposal_mode=99), "proposal_mode"),
    ("sparse_k absurd", gen(sparse_k=100_000), "sparse_k"),
    ("too many stop strings", gen(stop=["a"] * 9), "stop"),
    ("empty stop string", gen(stop=[""]), "stop"),
    ("huge stop string", gen(stop=["x" * 1000]), "stop"),
    ("replacement character in a stop string", gen(stop=["ok\ufffd"]), "U+FFFD"),
    ("non-ASCII request id", gen(request_id="r\u00e9q\n"), "request_id"),
    ("long request id", gen(request_id="r" * 500), "request_id"),
]


@pytest.mark.parametrize("service", ["draft", "verify"])
@pytest.mark.parametrize("name,req,field", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_rejects_bad_fields(svc, service, name, req, field):
    with pytest.raises(grpc.RpcError) as e:
        list(svc[service].Generate(req, timeout=TIMEOUT))
    assert e.value.code() == INVALID, (name, e.value.code(), e.value.details())
    assert field in e.value.details(), (name, e.value.details())


@pytest.mark.parametrize("service", ["draft", "verify"])
def test_oversized_message_is_resource_exhausted(svc, service):
    req = gen(prompt="w3 " * (6 << 20))  # 18 MiB > the 16 MiB default limit
    with pytest.raises(grpc.RpcError) as e:
        list(svc[service].Generate(req, timeout=TIMEOUT))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()


# ---- the Session stream (what a misbehaving draft could send) --------------------------------

def start(fp, **kw) -> pb.VerifyRequest:
    sampling = kw.pop("sampling", dict(temperature=1.0, seed=7))
    kw.setdefault("prompt_ids", [3, 4, 5])
    kw.setdefault("max_new_tokens", 40)
    kw.setdefault("proposal_mode", pb.PROPOSAL_MODE_SPARSE)
    return pb.VerifyRequest(start=pb.SessionStart(vocab_fingerprint=fp, sampling=pb.SamplingParams(**sampling), **kw))


def rnd(number, tokens, counts=None, ids=None, probs=None, parents=None) -> pb.VerifyRequest:
    if counts is None:  # default: each proposal has all the mass (a valid sparse q)
        counts, ids, probs = [1] * len(tokens), list(tokens), [1.0] * len(tokens)
    return pb.VerifyRequest(round=pb.Round(round=number, tokens=tokens, q_counts=counts, q_ids=ids or [], q_probs=probs or [],
                                           parents=parents or []))


R1 = rnd(1, [])  # a valid round with no proposals (the verifier adds one token)

# (name, start overrides, messages after start, expected code, field named in the message)
SESSION_CASES = [
    ("round before start", None, [R1], INVALID, "start"),
    ("empty message first", None, [pb.VerifyRequest()], INVALID, "start"),
    ("fingerprint mismatch", dict(fp="0" * 64), [], grpc.StatusCode.FAILED_PRECONDITION, "fingerprint"),
    ("empty prompt", dict(prompt_ids=[]), [], INVALID, "prompt_ids"),
    ("prompt id out of vocab", dict(prompt_ids=[3, V + 5]), [], INVALID, "prompt_ids"),
    ("prompt fills the context", dict(prompt_ids=[3] * CTX), [], INVALID, "prompt_ids"),
    ("max_new_tokens 0", dict(max_new_tokens=0), [], INVALID, "max_new_tokens"),
    ("max_new_tokens absurd", dict(max_new_tokens=10**9), [], INVALID, "max_new_tokens"),
    ("unknown proposal mode", dict(proposal_mode=42), [], INVALID, "proposal_mode"),
    ("temperature NaN", dict(sampling=dict(temperature=math.nan)), [], INVALID, "temperature"),
    ("top_p above 1", dict(sampling=dict(temperature=1.0, top_p=2.0)), [], INVALID, "top_p"),
    ("bad request id", dict(request_id="\u2603"), [], INVALID, "request_id"),
    ("second start", {}, ["START"], INVALID, "start"),
    ("second start after a round", {}, [R1, "START"], INVALID, "start"),
    ("empty message mid-session", {}, [pb.VerifyRequest()], INVALID, "round"),
    ("round 2 first", {}, [rnd(2, [])], INVALID, "round"),
    ("round 0", {}, [rnd(0, [])], INVALID, "round"),
    ("round repeated", {}, [R1, rnd(1, [])], INVALID, "round"),
    ("round skipped", {}, [R1, rnd(3, [])], INVALID, "round"),
    ("proposal out of vocab", {}, [rnd(1, [V])], INVALID, "round.tokens"),
    ("negative proposal", {}, [rnd(1, [-3])], INVALID, "round.tokens"),
    ("too many proposals", {}, [rnd(1, [3] * 65)], INVALID, "round.tokens"),
    ("more proposals than the context has room for", dict(prompt_ids=[3] * (CTX - 3)), [rnd(1, [3] * 8)], INVALID, "round.tokens"),
    ("q_counts shorter than tokens", {}, [rnd(1, [3, 4], [1], [3], [1.0])], INVALID, "q_counts"),
    ("q_ids longer than q_counts say", {}, [rnd(1, [3], [1], [3, 4], [0.5, 0.5])], INVALID, "q_counts"),
    ("q_probs shorter than q_ids", {}, [rnd(1, [3], [2], [3, 4], [1.0])], INVALID, "q_probs"),
    ("q id out of vocab", {}, [rnd(1, [3], [2], [3, V], [0.5, 0.5])], INVALID, "q_ids"),
    ("negative q id", {}, [rnd(1, [3], [2], [3, -1], [0.5, 0.5])], INVALID, "q_ids"),
    ("duplicate q id", {}, [rnd(1, [3], [2], [3, 3], [0.5, 0.5])], INVALID, "q_ids"),
    # refused by its counts, before any per-element work (a million such ids stalled the event loop for a second)
    ("more q ids at a position than the vocabulary has", {}, [rnd(1, [3], [V + 1], [3] + [4] * V, [1.0] + [0.0] * V)], INVALID,
     "round.q_counts"),
    ("negative probability", {}, [rnd(1, [3], [2], [3, 4], [1.5, -0.5])], INVALID, "q_probs"),
    ("NaN probability", {}, [rnd(1, [3], [2], [3, 4], [math.nan, 0.5])], INVALID, "q_probs"),
    ("inf probability", {}, [rnd(1, [3], [1], [3], [math.inf])], INVALID, "q_probs"),
    ("probability above 1", {}, [rnd(1, [3], [1], [3], [1.5])], INVALID, "q_probs"),
    ("unnormalized q", {}, [rnd(1, [3], [2], [3, 4], [0.3, 0.3])], INVALID, "q_probs"),
    ("proposed token not in its q", {}, [rnd(1, [3], [2], [4, 5], [0.5, 0.5])], INVALID, "q_probs"),
    ("proposed token with zero mass", {}, [rnd(1, [3], [2], [3, 4], [0.0, 1.0])], INVALID, "q_probs"),
    ("dense q of the wrong length", dict(proposal_mode=pb.PROPOSAL_MODE_DENSE), [rnd(1, [3], [], [], [1.0 / V] * (V - 1))], INVALID, "q_probs"),
    ("dense q with q_ids", dict(proposal_mode=pb.PROPOSAL_MODE_DENSE), [rnd(1, [3], [1], [3], [1.0 / V] * V)], INVALID, "q_probs"),
    ("ids-only mode sending q", dict(proposal_mode=pb.PROPOSAL_MODE_GREEDY), [rnd(1, [3])], INVALID, "q_"),
    ("fewer parents than tokens", {}, [rnd(1, [3, 4, 5], parents=[-1, 0])], INVALID, "round.parents"),
    ("a parent after its child", {}, [rnd(1, [3, 4, 5], parents=[-1, 2, 0])], INVALID, "round.parents[1]"),
    ("a node its own parent", {}, [rnd(1, [3, 4], parents=[-1, 1])], INVALID, "round.parents[1]"),
    ("a parent below -1", {}, [rnd(1, [3, 4], parents=[-2, 0])], INVALID, "round.parents[0]"),
    ("a tree of too many nodes", {}, [rnd(1, [3] * 65, parents=[-1] * 65)], INVALID, "round.tokens"),
]


@pytest.mark.parametrize("name,overrides,after,code,field", SESSION_CASES, ids=[c[0] for c in SESSION_CASES])
def test_session_rejects_bad_messages(svc, name, overrides, after, code, field):
    ov = None if overrides is None else dict(overrides)
    fp = ov.pop("fp", svc["fp"]) if ov else svc["fp"]
    first = [] if ov is None else [start(fp, **ov)]
    msgs = first + [start(svc["fp"]) if m == "START" else m for m in after]
    out, got, details = session(svc["verify"], msgs)
    assert got == code, (name, got, details)
    assert field in details, (name, details)
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out), "the session ended before the bad message"


def test_a_valid_session_runs_to_its_end(svc):
    """The control for the table above: the same start and well-formed rounds are accepted."""
    msgs = [start(svc["fp"], max_new_tokens=6)] + [rnd(i, [3, 4], [2, 2], [3, 4, 4, 5], [0.5, 0.5, 0.25, 0.75]) for i in range(1, 7)]
    out, code, details = session(svc["verify"], msgs)
    assert code == grpc.StatusCode.OK, details
    assert out and out[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_a_valid_tree_session_runs_to_its_end(svc):
    """Tree rounds (node 2 a child of node 0; nodes 0 and 1 siblings, the second drawn from what the
    first left): every verdict names a path of the tree, root first, num_accepted long."""
    tree = dict(counts=[2, 1, 1], ids=[3, 4, 4, 5], probs=[0.5, 0.5, 1.0, 1.0], parents=[-1, -1, 0])
    msgs = [start(svc["fp"], max_new_tokens=12)] + [rnd(i, [3, 4, 5], **tree) for i in range(1, 13)]
    out, code, details = session(svc["verify"], msgs)
    assert code == grpc.StatusCode.OK, details
    assert out and out[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    paths = [list(r.accepted_path) for r in out]
    assert all(len(p) == r.num_accepted and p in ([], [0], [1], [0, 2]) for p, r in zip(paths, out)), paths
    assert any(paths), "some proposal must be accepted for this to test anything"


def test_services_healthy_after_the_tables(svc):
    assert_healthy(svc)


# ---- property-based: generated garbage --------------------------------------------------------
# Each field is mostly valid and sometimes garbage, so requests fail on one or two fields at a
# time and a good share run all the way (a request that is all garbage only ever tests the
# first check).

def mostly(good, bad, one_in: int = 8):
    return st.integers(0, one_in - 1).flatmap(lambda i: bad if i == 0 else good)


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -0.0, 1e-38, 1e-5, 1.0 + 1e-6]))
_u32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 2**31, 2**32 - 1]))
_words = st.lists(st.sampled_from([f"w{i}" for i in range(3, V)]), min_size=1, max_size=6).map(" ".join)
_text = st.one_of(st.text(max_size=20), st.lists(st.sampled_from(["w3", "w4", "w9", "w15", "<eos>", "zz", " "]), max_size=6).map(" ".join))
_good_ids = st.lists(st.integers(3, V - 1), min_size=1, max_size=8)
_bad_ids = st.one_of(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8), st.just([3] * CTX), st.just([]))


@st.composite
def generate_requests(draw):
    prompt = draw(mostly(_words, _text))
    ids = draw(mostly(_good_ids, _bad_ids))
    which = draw(st.integers(0, 9))  # 0: both (invalid), 1-4: ids, else text
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    sampling = pb.SamplingParams(
        temperature=draw(mostly(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]), _floats)),
        top_k=draw(mostly(st.integers(0, 20), _u32)),
        top_p=draw(mostly(st.sampled_from([0.0, 0.5, 0.9, 1.0]), _floats)),
        **({} if seed is None else {"seed": seed}))
    return pb.GenerateRequest(
        prompt="" if 1 <= which <= 4 else prompt, prompt_ids=ids if which <= 4 else [],
        max_new_tokens=draw(mostly(st.integers(1, 6), st.one_of(_u32, st.sampled_from([0, CTX - 1, CTX, CTX + 1])))),
        sampling=sampling,
        stop=draw(mostly(st.sampled_from([[], [], ["w5"], ["w5 w6", "w7"]]), st.lists(st.text(max_size=300), max_size=10))),
        num_draft_tokens=draw(mostly(st.integers(0, 8), st.one_of(_u32, st.sampled_from([32, 33])))),
        proposal_mode=draw(mostly(st.integers(0, 3), st.integers(-5, 2**31 - 1))),
        sparse_k=draw(mostly(st.integers(0, 40), _u32)),
        request_id=draw(mostly(st.sampled_from(["", "req-1"]), st.text(max_size=200))),
    )


PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), print_blob=True)


@PROPERTY
@given(req=generate_requests())
def test_garbage_generate_requests_get_clean_statuses(svc, req):
    for service in ("draft", "verify"):
        code = call_generate(svc[service], req)
        event(f"{service}: {code.name}")
        assert code in CLEAN, (service, code, req)


@st.composite
def good_q(draw, tokens, mode):
    """A q each proposal could have been sampled from, in the session's proposal mode."""
    if mode == pb.PROPOSAL_MODE_GREEDY:
        return [], [], []
    if mode == pb.PROPOSAL_MODE_DENSE:
        return [], [], [1.0 / V] * (V * len(tokens))
    counts, ids, probs = [], [], []
    for t in tokens:
        others = draw(st.lists(st.sampled_from([x for x in range(V) if x != t]), max_size=4, unique=True))
        w = draw(st.lists(st.floats(0.01, 1.0), min_size=len(others) + 1, max_size=len(others) + 1))
        counts.append(len(others) + 1)
        ids += [t] + others
        probs += [x / sum(w) for x in w]
    return counts, ids, probs


@st.composite
def garbage_round(draw, number, mode):
    tokens = draw(mostly(st.lists(st.integers(0, V - 1), max_size=5), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)))
    counts, ids, probs = draw(good_q(tokens, mode)) if all(0 <= t < V for t in tokens) else ([1] * len(tokens), tokens, [1.0] * len(tokens))
    spoil = draw(st.integers(0, 9))
    if spoil == 0 and probs:
        probs[draw(st.integers(0, len(probs) - 1))] = draw(_floats)
    elif spoil == 1:
        counts = draw(st.lists(st.integers(0, 5), max_size=6))
    elif spoil == 2:
        ids = draw(st.lists(st.integers(-3, V + 3), max_size=12))
    elif spoil == 3:
        probs = draw(st.lists(_floats, max_size=3 * V))
    parents = draw(st.one_of(st.just([]), st.lists(st.integers(-3, 6), max_size=len(tokens) + 1),
                             st.builds(lambda xs: [min(x, i - 1) for i, x in enumerate(xs)], st.lists(st.integers(-1, 5), min_size=len(tokens),
                                                                                                     max_size=len(tokens)))))
    return pb.VerifyRequest(round=pb.Round(round=number, tokens=tokens, q_counts=counts, q_ids=ids, q_probs=probs, parents=parents))


@st.composite
def garbage_sessions(draw, fp):
    mode = draw(mostly(st.sampled_from([pb.PROPOSAL_MODE_GREEDY, pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_DENSE]), st.integers(0, 2**31 - 1)))
    start_msg = pb.VerifyRequest(start=pb.SessionStart(
        prompt_ids=draw(mostly(_good_ids, _bad_ids)),
        max_new_tokens=draw(mostly(st.integers(1, 12), st.one_of(_u32, st.just(0)))),
        sampling=pb.SamplingParams(temperature=draw(mostly(st.sampled_from([0.0, 0.7, 1.0]), _floats)), top_k=draw(st.integers(0, 20)),
                                   top_p=draw(mostly(st.sampled_from([0.0, 0.9, 1.0]), _floats)), seed=draw(st.integers(0, 2**64 - 1))),
        proposal_mode=mode,
        vocab_fingerprint=draw(mostly(st.just(fp), st.text(max_size=64))),
        request_id=draw(mostly(st.just("prop"), st.text(max_size=200)))))
    msgs = [] if draw(st.integers(0, 15)) == 0 else [start_msg]
    expected = 1
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 19))
        if kind == 0:
            msgs.append(pb.VerifyRequest())
        elif kind == 1:
            msgs.append(start_msg)
        else:
            number = draw(mostly(st.just(expected), st.one_of(_u32, st.sampled_from([expected - 1, expected + 1]))))
            msgs.append(draw(garbage_round(number, mode)))
            expected += 1
    return msgs


@PROPERTY
@given(data=st.data())
def test_garbage_session_streams_get_clean_statuses(svc, data):
    msgs = data.draw(garbage_sessions(svc["fp"]))
    out, code, details = session(svc["verify"], msgs)
    event(f"{code.name} after {len(out)} verdicts")
    assert code in CLEAN, (code, details, msgs)


def test_services_healthy_after_the_garbage(svc):
    assert_healthy(svc)


def test_a_text_prompt_with_tokens_past_the_models_rows_is_invalid():
    """A checkpoint whose tokenizer has tokens the model has no row for (added tokens): a text
    prompt with one passed validation (only prompt_ids were checked), and the embedding lookup
    failed (INTERNAL on the CPU, a device-side assert on CUDA). It is INVALID_ARGUMENT, named."""
    from bench.tinymodels import word_tokenizer
    from specdec.errors import Refusal, RequestError
    from specdec.validation import parse_generate

    tok = word_tokenizer(16)  # ids 0-15; the model below has 8 rows
    with pytest.raises(RequestError) as e:
        parse_generate(pb.GenerateRequest(prompt="w3 w12", max_new_tokens=4), tok, 8, 64)
    assert e.value.kind == Refusal.INVALID_ARGUMENT and "prompt: tokenizes to id 12, outside the model's 8 rows" in str(e.value)
    assert parse_generate(pb.GenerateRequest(prompt="w3 w7", max_new_tokens=4), tok, 8, 64).prompt_ids == [3, 7]


def test_a_dense_round_past_the_message_limit_is_refused_up_front(services, model_dir):
    """From a review: nothing held a DENSE request's rounds (tau x V probabilities each) to
    --max-message-bytes. A round past it failed at its write, which the draft reported as a
    retryable UNAVAILABLE after marking the verify replicas full, or mid-stream where the first
    rounds were small. Now such a request is INVALID_ARGUMENT up front, naming the limit and what
    fits; one that fits runs."""
    from bench.launch import Service

    v, _ = services("target", "draft")
    d = Service("draft_service", "--model", model_dir("draft"), "--verify", v.address, "--metrics-port", "0",
                "--max-message-bytes", "2048")  # V = 16: a round of 22 proposals fits, 23 do not
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = pb_grpc.DraftStub(ch)
            sampled = dict(temperature=1.0, seed=5)
            for big in (gen(proposal_mode=pb.PROPOSAL_MODE_DENSE, num_draft_tokens=23, sampling=sampled),
                        gen(proposal_mode=pb.PROPOSAL_MODE_DENSE, tree_budget=32, sampling=sampled)):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(big, timeout=TIMEOUT))
                assert e.value.code() == INVALID and "--max-message-bytes 2048" in e.value.details(), e.value.details()
                assert "at most 22 proposals" in e.value.details()
            fits = gen(proposal_mode=pb.PROPOSAL_MODE_DENSE, num_draft_tokens=22, max_new_tokens=24, adaptive=False, sampling=sampled)
            assert [t for c in stub.Generate(fits, timeout=TIMEOUT) for t in c.token_ids]  # ran to its end (EOS or 24 tokens)
            assert call_generate(stub, gen(proposal_mode=pb.PROPOSAL_MODE_SPARSE, num_draft_tokens=32, sampling=sampled)) == grpc.StatusCode.OK
    finally:
        d.stop()
