"""Security (issue 7, point 3): mutual TLS on both hops and a bearer token on the client-facing
service, with certificates made in the test by the `openssl` command.

One pair of processes: the verify service is configured through environment variables
(SPECDEC_TLS_*), the draft service through flags; the draft requires client certificates, talks
mTLS to the verify service and checks a bearer token (--auth-token-file); its HTTP front door
(--http-port) follows the same --tls-* flags and token."""
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys

import grpc
import pytest

from bench.launch import ENV, ROOT, Service
from client import Client
from helpers import assert_health_and_reflection, metric, wait_for
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)


def make_cert(d, name, ca, usage):
    """A certificate for 127.0.0.1 / localhost signed by `ca`."""
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(f"basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    make_cert(d, "server", "ca", "serverAuth,clientAuth")
    make_cert(d, "client", "ca", "clientAuth")
    make_cert(d, "rogue", "rogue-ca", "clientAuth")
    with open(os.path.join(d, "token"), "w") as f:
        f.write(TOKEN + "\n")
    return lambda name: os.path.join(d, name)


@pytest.fixture(scope="module")
def secure_pair(pki, model_dir):
    venv = dict(ENV, SPECDEC_TLS_CERT=pki("server.pem"), SPECDEC_TLS_KEY=pki("server.key"), SPECDEC_TLS_CLIENT_CA=pki("ca.pem"))
    v = Service("verify_service", "--model", model_dir("target"), "--metrics-port", "0", env=venv)
    d = Service("draft_service", "--model", model_dir("draft"), "--verify", v.address, "--metrics-port", "0",
                "--tls-cert", pki("server.pem"), "--tls-key", pki("server.key"), "--tls-client-ca", pki("ca.pem"),
                "--verify-tls-ca", pki("ca.pem"), "--verify-tls-cert", pki("client.pem"), "--verify-tls-key", pki("client.key"),
                "--auth-token-file", pki("token"), "--http-port", "0")
    yield v, d
    d.stop()
    v.stop()


def tls(pki, cert="client"):
    return dict(tls_ca=pki("ca.pem"), tls_cert=pki(f"{cert}.pem") if cert else None, tls_key=pki(f"{cert}.key") if cert else None)


def channel(pki, address, cert="client"):
    read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
    c = tls(pki, cert)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(c["tls_ca"]), read(c["tls_key"]), read(c["tls_cert"])))


def test_mtls_on_both_hops_generates(secure_pair, pki):
    v, d = secure_pair
    with Client(d.address, timeout=60, token=TOKEN, **tls(pki)) as c:
        spec = c.generate(prompt="w3 w4 w5", max_new_tokens=10)
        sampled = c.generate(prompt_ids=[3, 4], max_new_tokens=8, temperature=1.0, seed=3)
    assert spec.finish_reason in ("eos", "length") and spec.stats["rounds"] >= 1
    assert sampled.seed == 3 and sampled.token_ids
    with Client(v.address, target_only=True, timeout=60, **tls(pki)) as c:  # mTLS to the verify service directly
        assert c.generate(prompt="w3 w4 w5", max_new_tokens=10).token_ids == spec.token_ids


@pytest.mark.parametrize("who", ["draft", "verify"])
@pytest.mark.parametrize("how", ["plaintext", "no client certificate", "certificate from another CA"])
def test_clients_without_a_trusted_certificate_are_refused(secure_pair, pki, who, how):
    v, d = secure_pair
    address = d.address if who == "draft" else v.address
    if how == "plaintext":
        ch = grpc.insecure_channel(address)
    else:
        ch = channel(pki, address, cert=None if how == "no client certificate" else "rogue")
    with ch, pytest.raises(grpc.RpcError) as e:
        stub = pb_grpc.DraftStub(ch) if who == "draft" else pb_grpc.VerifyStub(ch)
        list(stub.Generate(pb.GenerateRequest(prompt_ids=[3], max_new_tokens=2), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")]))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()


def test_a_client_that_does_not_trust_the_server_refuses_it(secure_pair, pki):
    _, d = secure_pair
    creds = grpc.ssl_channel_credentials(open(pki("rogue-ca.pem"), "rb").read(), open(pki("client.key"), "rb").read(),
                                         open(pki("client.pem"), "rb").read())
    with grpc.secure_channel(d.address, creds) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.DraftStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1]])  # "": refused by the client itself (test_client_edges)
def test_bearer_token_is_required(secure_pair, pki, token):
    _, d = secure_pair
    before = metric(d.metrics(), "specdec_request_errors_total", service="draft", method="Generate", code="UNAUTHENTICATED")
    with Client(d.address, timeout=30, token=token, **tls(pki)) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=[3], max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            c.info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = metric(d.metrics(), "specdec_request_errors_total", service="draft", method="Generate", code="UNAUTHENTICATED")
    assert after == before + 1


def test_wrong_scheme_is_refused(secure_pair, pki):
    _, d = secure_pair
    with channel(pki, d.address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.DraftStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=[("authorization", f"Basic {TOKEN}")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with channel(pki, d.address) as ch:  # the scheme's name is case-insensitive (RFC 7235): `bearer` is Bearer
        assert pb_grpc.DraftStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=[("authorization", f"bearer {TOKEN}")]).model_name
    assert https(pki, d, scheme="BEARER").status == 200


def test_health_and_reflection_need_no_token(secure_pair, pki):
    v, d = secure_pair
    for svc, name in ((d, "specdec.v1.Draft"), (v, "specdec.v1.Verify")):
        with channel(pki, svc.address) as ch:
            assert_health_and_reflection(ch, name)


def test_cli_with_tls_and_token(secure_pair, pki):
    _, d = secure_pair
    base = [sys.executable, "-m", "client", "generate", "--server", d.address, "--prompt", "w3 w4", "--max-new-tokens", "5", "--json",
            "--tls-ca", pki("ca.pem"), "--tls-cert", pki("client.pem"), "--tls-key", pki("client.key")]
    ok = subprocess.run(base + ["--token", TOKEN], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error: UNAUTHENTICATED: missing bearer token" in bad.stderr


NODE_CLIENT = os.path.join(ROOT, "clients", "node", "generate.js")


@pytest.mark.skipif(shutil.which("node") is None or not os.path.isdir(os.path.join(ROOT, "clients", "node", "node_modules", "@grpc")),
                    reason="needs node and clients/node's packages (make test runs npm ci there where npm is installed)")
def test_node_client_with_tls_and_token(secure_pair, pki, tmp_path):
    """The client written from the .proto had no TLS or token: it could not reach a secured service."""
    _, d = secure_pair
    with Client(d.address, token=TOKEN, timeout=60, **tls(pki)) as c:
        want = c.generate(prompt_ids=[3, 4], max_new_tokens=5)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    base = ["node", NODE_CLIENT, "--server", d.address, "--prompt-ids", "3,4", "--max-new-tokens", "5",
            "--tls-ca", pki("ca.pem"), "--tls-cert", pki("client.pem"), "--tls-key", pki("client.key")]
    for creds in (["--token-file", str(token)], ["--token", TOKEN]):
        ok = subprocess.run(base + creds, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["token_ids"] == want.token_ids
    for args, says in ((base, "UNAUTHENTICATED: missing bearer token"),
                       (base + ["--token", "wrong"], "UNAUTHENTICATED"),
                       (base[:-4] + ["--token", TOKEN], "UNAVAILABLE")):  # no client certificate: the handshake fails
        bad = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and bad.stderr.startswith("error: " + says), bad.stderr


def https(pki, d, cert="client", token=TOKEN, scheme="Bearer"):
    ctx = ssl.create_default_context(cafile=pki("ca.pem"))
    if cert:
        ctx.load_cert_chain(pki(f"{cert}.pem"), pki(f"{cert}.key"))
    conn = http.client.HTTPSConnection(*d.http_address.split(":"), context=ctx, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "target", "prompt": "w3 w4", "max_tokens": 3, "temperature": 0}),
                 {"Content-Type": "application/json", **({"Authorization": f"{scheme} {token}"} if token else {})})
    return conn.getresponse()


def test_http_front_door_follows_the_tls_flags_and_the_token(secure_pair, pki):
    _, d = secure_pair
    ok = https(pki, d)
    assert ok.status == 200 and json.loads(ok.read())["usage"]["completion_tokens"] >= 1
    assert https(pki, d, token=None).status == 401
    # logged with the caller's address, as the gRPC door's refusals are
    assert wait_for(lambda: any('"http_status": 401' in line and '"code": "UNAUTHENTICATED"' in line and '"peer": "127.0.0.1:' in line for line in d.stderr), 10), d.stderr[-3:]
    for cert in (None, "rogue"):  # mTLS: no certificate, or one from another CA
        with pytest.raises((ssl.SSLError, ConnectionError)):
            https(pki, d, cert=cert).read()
    conn = http.client.HTTPConnection(*d.http_address.split(":"), timeout=10)  # plaintext
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/health")
        conn.getresponse()


def test_a_certificate_with_another_key_exits_2_with_one_line(pki, model_dir):
    """From a review: a --tls-cert / --tls-key that are not one pair were found by gRPC only after
    the model load, and its three log lines came before the service's own one-line refusal. Now
    it is checked with the other files, before the model libraries load."""
    r = subprocess.run([sys.executable, "-m", "verify_service", "--model", model_dir("target"), "--port", "0",
                        "--tls-cert", pki("server.pem"), "--tls-key", pki("client.key")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "--tls-cert" in lines[0] and "not a certificate and its private key" in lines[0], lines[0]


def test_a_ca_flag_without_a_certificate_is_one_line_exit_2(pki, model_dir):
    """From a review: a CA flag naming a PEM file that holds no certificate (a key) passed the
    start-up checks: the verify service loaded its model, then failed to start its server blaming
    --port; the draft given such a --verify-tls-ca never served (NOT_SERVING for ever)."""
    cert = ["--tls-cert", pki("server.pem"), "--tls-key", pki("server.key")]
    for module, args, flag in (("verify_service", [*cert, "--tls-client-ca", pki("client.key")], "--tls-client-ca"),
                               ("draft_service", ["--verify", "127.0.0.1:1", "--verify-tls-ca", pki("client.key")], "--verify-tls-ca")):
        r = subprocess.run([sys.executable, "-m", module, "--model", model_dir("target"), "--port", "0", *args], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith(f"python -m {module}: error: {flag} {pki('client.key')}: no CA certificate in it"), \
            r.stderr[-2000:]
