"""A client written in another language from the .proto alone: clients/node/generate.js loads
protos/specdec/v1/specdec.proto at run time (@grpc/proto-loader, @grpc/grpc-js; `make test`
installs them with npm) and streams a generation from the real services. A request without the
tree fields (what a client written before them sends) is a chain; with tree_budget it is a tree;
both give the Python client's greedy tokens, and a budget over the verifier's limit is
INVALID_ARGUMENT naming it."""
import json
import os
import shutil
import subprocess

import pytest

from bench.launch import ROOT
from client import Client

NODE_DIR = os.path.join(ROOT, "clients", "node")
pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "@grpc", "grpc-js")),
    reason="needs node and clients/node's packages (make test runs npm ci there where npm is installed)")


def node(*args):
    r = subprocess.run(["node", os.path.join(NODE_DIR, "generate.js"), *args], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_node_client_streams_chains_and_trees_from_the_proto(services):
    v, d = services("target", "draft")
    with Client(d.address, timeout=60) as c:
        want = c.generate(prompt_ids=[3, 4, 5], max_new_tokens=12).token_ids
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--max-new-tokens", "12")
    assert rc == 0, err
    chain = json.loads(out)
    assert chain["token_ids"] == want and chain["finish_reason"] in ("eos", "length")
    assert chain["stats"]["rounds"] >= 1 and chain["stats"]["tree_rounds"] == 0
    assert chain["stats"]["generated_tokens"] == len(want) and chain["seed"].isdigit()  # a uint64: a decimal string
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--max-new-tokens", "12", "--tree-budget", "8",
                        "--tau", "3", "--proposer", "draft")
    assert rc == 0, err
    tree = json.loads(out)
    assert tree["token_ids"] == want and tree["stats"]["tree_rounds"] > 0
    rc, out, err = node("--server", v.address, "--target-only", "--prompt-ids", "3,4,5", "--max-new-tokens", "12",
                        "--timeout", "1e300")  # no deadline (it was an invalid Date: DEADLINE_EXCEEDED at once)
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == want
    rc, out, err = node("--server", v.address, "--target-only", "--prompt-ids", "3,4,5", "--max-new-tokens", "12",
                        "--timeout", "inf")  # the Python client's word for none (it was refused as not a number)
    assert rc == 0 and json.loads(out)["token_ids"] == want, err


def test_node_client_sampled_seed_round_trips_as_uint64(services):
    """A uint64 seed past 2**53 travels exactly (a decimal string in JavaScript), and a seeded
    request gives the Python client's tokens."""
    _, d = services("target", "draft")
    seed = 2**64 - 1
    with Client(d.address, timeout=60) as c:
        want = c.generate(prompt_ids=[3, 4], max_new_tokens=10, temperature=0.9, seed=seed)
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4", "--max-new-tokens", "10", "--temperature", "0.9",
                        "--seed", str(seed))
    assert rc == 0, err
    got = json.loads(out)
    assert got["seed"] == str(seed) and got["token_ids"] == want.token_ids


def test_node_client_sends_every_request_field(services):
    """The client sent only the prompt, length, tau, tree budget, proposer, temperature and seed:
    top-k, top-p, stop strings, the proposal mode, sparse K, the request id and the adaptive and
    pre-drafting switches reach the service as the Python client sends them (same seeded tokens)."""
    _, d = services("target", "draft")
    fixed = dict(prompt_ids=[3, 4, 5], max_new_tokens=16, temperature=0.8, num_draft_tokens=3, adaptive=False, predraft=False)
    with Client(d.address, timeout=60) as c:
        greedy = c.generate(prompt_ids=[3, 4, 5], max_new_tokens=16)
        for seed in range(10):  # a seed whose draws top-k / top-p change, so the test sees whether they arrive
            want = c.generate(**fixed, top_k=2, top_p=0.5, seed=seed, proposal_mode="sparse", sparse_k=3)
            if want.token_ids != c.generate(**fixed, seed=seed).token_ids:
                break
        else:
            pytest.fail("top-k and top-p changed no seed's tokens")
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--max-new-tokens", "16", "--temperature", "0.8",
                        "--top-k", "2", "--top-p", "0.5", "--seed", str(seed), "--mode", "sparse", "--sparse-k", "3", "--tau", "3",
                        "--no-adaptive", "--no-predraft", "--request-id", "node-req-1")
    assert rc == 0, err
    got = json.loads(out)
    assert got["token_ids"] == want.token_ids and got["request_id"] == "node-req-1"
    stop = greedy.text[len(greedy.text) // 2:][:3]
    assert stop, greedy.text
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--max-new-tokens", "16", "--stop", "zzz-never", "--stop", stop)
    assert rc == 0, err
    got = json.loads(out)
    assert got["finish_reason"] == "stop" and got["text"] == greedy.text[:greedy.text.index(stop)]


@pytest.mark.parametrize("args,says", [
    (["--seed", "-1"], "--seed"), (["--seed", "18446744073709551616"], "--seed"), (["--proposer", "drafts"], "--proposer"),
    (["--max-new-tokens", "4294967296"], "--max-new-tokens"), (["--temperature", "x"], "--temperature"), (["--tau"], "--tau"),
    (["--prompt-ids", "2147483648"], "--prompt-ids"),  # int32 on the wire: 3000000000 was sent as -1294967296
    (["--timeout", "0"], "--timeout"), (["--timeout", "-1"], "--timeout"), (["--timeout", "nan"], "--timeout"),
    # a float32 on the wire: 1e-50 was sent as 0 (greedy while the caller believed it sampled), 1e39 as inf
    (["--temperature", "1e-50"], "--temperature"), (["--temperature", "1e39"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--tls-cert", "c.pem"], "--tls-key"), (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: no such file"),
    (["--tls-ca", __file__], "no CA certificate in it"),  # a file that is no certificate went through to the handshake (UNAVAILABLE)
    (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token"), (["--token", ""], "--token: empty token"),
    # grpc-js's own refusal printed the token in its message
    (["--token", "hunter2\nx"], "--token: the token must be one line of printable ASCII"),
    (["--token", "hunter\u00e92"], "--token: the token must be one line of printable ASCII"),
    (["--top-p", "1e-46"], "--top-p 1e-46 arrives as 0"), (["--top-p", "1.5"], "--top-p"),  # 1e-46 went as 0: no nucleus
    (["--early-stop-p", "1e-46"], "--early-stop-p 1e-46 arrives as 0"), (["--early-stop-p", "-0.5"], "--early-stop-p"),
])
def test_node_client_refuses_bad_flags_before_calling(args, says):
    """What the wire would silently wrap or zero (a uint64 or uint32 out of range, an unknown enum
    name, NaN) is refused by the client itself: exit 2, naming the flag, nothing sent."""
    rc, out, err = node("--server", "127.0.0.1:1", "--prompt-ids", "3", *args)
    assert rc == 2 and out == "" and says in err and "hunter" not in err and len(err.strip().splitlines()) == 1, err


def test_node_client_gets_invalid_argument_naming_the_tree_limit(services):
    _, d = services("target", "draft")
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--tree-budget", "65")
    assert rc == 1 and out == ""
    assert err.startswith("error: INVALID_ARGUMENT:") and "tree_budget" in err and "64" in err, err


def test_node_client_sends_top_p_0_early_stop_and_special_tokens(services):
    """--top-p 0 (the proto's "unset") was refused; --early-stop-p and --add-special-tokens were
    missing: each reaches the service as the Python client sends it."""
    _, d = services("target", "draft")
    fixed = dict(max_new_tokens=16, num_draft_tokens=4, adaptive=False, predraft=False)
    with Client(d.address, timeout=60) as c:
        early = c.generate(prompt_ids=[3, 4, 5], early_stop_p=0.9, **fixed)
        plain = c.generate(prompt_ids=[3, 4, 5], **fixed)
        bare = c.generate(prompt="w3 w4", add_special_tokens=False, max_new_tokens=8)
        special = c.generate(prompt="w3 w4", max_new_tokens=8)
    assert early.stats["drafted"] != plain.stats["drafted"]  # the threshold shortens rounds here, so it shows
    flags = ["--max-new-tokens", "16", "--tau", "4", "--no-adaptive", "--no-predraft"]
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--early-stop-p", "0.9", *flags)
    assert rc == 0, err
    assert json.loads(out)["stats"]["drafted"] == early.stats["drafted"]
    rc, out, err = node("--server", d.address, "--prompt-ids", "3,4,5", "--temperature", "0", "--top-p", "0", *flags)
    assert rc == 0 and json.loads(out)["token_ids"] == plain.token_ids, err
    for switch, want in (("--no-add-special-tokens", bare), ("--add-special-tokens", special)):
        rc, out, err = node("--server", d.address, "--prompt", "w3 w4", "--max-new-tokens", "8", switch)
        assert rc == 0 and json.loads(out)["stats"]["prompt_tokens"] == want.stats["prompt_tokens"], (switch, err)


def test_node_client_keeps_a_result_whose_call_failed_after_its_last_chunk(tmp_path):
    """A deadline that passes after the last chunk, while the server ends the call, made a whole
    result an error (exit 1, nothing printed). Swapped TLS files printed OpenSSL's words alone."""
    import time
    from concurrent import futures

    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    class LateEnd(pb_grpc.DraftServicer):
        def Generate(self, request, context):
            yield pb.GenerateResponse(token_ids=[5], text="w5", finish_reason=pb.FINISH_REASON_LENGTH)
            for _ in range(80):  # the call's end 4 s later
                if not context.is_active():
                    return
                time.sleep(0.05)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_DraftServicer_to_server(LateEnd(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc, out, err = node("--server", f"127.0.0.1:{port}", "--prompt-ids", "3", "--timeout", "2")
    finally:
        server.stop(0)
    assert rc == 0 and json.loads(out)["token_ids"] == [5], err
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "a.key", "-out", "a.pem", "-subj", "/CN=a", "-days", "1"], cwd=tmp_path, check=True, capture_output=True)
    rc, out, err = node("--server", "127.0.0.1:1", "--prompt-ids", "3", "--tls-cert", str(tmp_path / "a.key"), "--tls-key", str(tmp_path / "a.pem"))
    assert rc == 2 and err.startswith("error: --tls-cert/--tls-key: not usable TLS files") and len(err.strip().splitlines()) == 1, err
