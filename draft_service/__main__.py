"""python -m draft_service --model DIR --port P --verify HOST:PORT [--host H] ...

Flags and token files are checked before the model libraries load; any start-up failure is one
stderr line and exit code 2 (specdec/startup.py). A verify service that refuses the session
token or has another vocabulary is such a failure; one that does not answer yet is not: the
draft waits --verify-wait-s, starts NOT_SERVING, and its health follows the verify service."""
from __future__ import annotations

import argparse
import asyncio
import logging

from draft_service.adaptive import RUN_TOKENS_PER_VERDICT
from specdec import auth, startup
from specdec.startup import StartupError, add_switch, env, number

PROPOSERS = ("draft", "hybrid", "lookup")  # pb.Proposer's names, lower case
log = logging.getLogger("specdec.draft")


async def run(args, token_auth=None) -> None:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2  # noqa: PLC0415

    from draft_service import calibrate, http  # noqa: PLC0415
    from draft_service.server import DraftServicer  # noqa: PLC0415
    from draft_service.upstream import VerifyCheck, replicas  # noqa: PLC0415
    from specdec import serving  # noqa: PLC0415
    from specdec.lm import LM  # noqa: PLC0415
    from specdec.v1 import specdec_pb2 as pb  # noqa: PLC0415
    from specdec.v1 import specdec_pb2_grpc as pb_grpc  # noqa: PLC0415

    from draft_service.decode import drafting_executor  # noqa: PLC0415

    asyncio.get_running_loop().set_default_executor(drafting_executor(args.max_sessions))
    # compiled layers are the verifier's default on CUDA, measured there; the draft's steps are not measured with them
    lm = LM.load(args.model, args.device, args.dtype, choices=args.engine_choices, compiled=False)
    verify = replicas(args)
    check = VerifyCheck(args, verify, lm)
    target = None
    if await verify.wait_ready(args.verify_wait_s):
        first = verify.best()
        why = await check.refusal(first.info, first.stub)
        if why:
            raise StartupError(why)
        target = first.info
    elif (e := verify.refusal()) is not None:
        raise StartupError(check.token_refused(e.code(), e.details()))
    elif verify.refusal(grpc.StatusCode.UNIMPLEMENTED) is not None:  # it answers, but has no Verify service: not "unreachable"
        raise StartupError(f"--verify {args.verify}: not a verify service (Verify.Info is UNIMPLEMENTED there: another server's port?)")
    else:
        log.warning("verify service not reachable yet; NOT_SERVING until it answers", extra={"fields": {"verify": args.verify}})
    servicer = DraftServicer(lm, verify, target, adaptive=args.adaptive, predraft=args.predraft, proposer=pb.Proposer.Value(f"PROPOSER_{args.proposer.upper()}"),
                             draft_fallback=args.draft_fallback, goodput=args.goodput,
                             costs=calibrate.parse_costs(args.costs_ms) if args.costs_ms else None,
                             round_timeout_s=args.verify_round_timeout_s, run_tokens=args.run_tokens_per_verdict,
                             client_write_timeout_s=args.client_write_timeout_s, max_sessions=args.max_sessions,
                             max_message_bytes=args.max_message_bytes)
    if target is not None and (args.adaptive or args.draft_fallback):
        await servicer.costs()  # calibrate now, not at the first request
    front = http.FrontDoor(servicer, args, token_auth, model=target.model_name if target is not None else "") if args.http_port is not None else None
    if front is not None:
        front.upstream = target is not None
    tasks = set()

    def on_start(set_health):
        async def set_both(status) -> None:  # the HTTP /health follows the gRPC health
            if front is not None:
                front.upstream = status == health_pb2.HealthCheckResponse.SERVING
            await set_health(status)
        tasks.add(asyncio.get_running_loop().create_task(check.watch(servicer, set_both, target is not None)))

    ready = health_pb2.HealthCheckResponse.SERVING if target is not None else health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        await serving.serve(args, "specdec.v1.Draft", lambda s: pb_grpc.add_DraftServicer_to_server(servicer, s), interceptors=[token_auth],
                            ready=ready, on_start=on_start, http=front)
    finally:
        for t in tasks:
            t.cancel()
        await verify.close()


def add_http_args(p) -> None:
    """The HTTP front door's flags (draft_service/http.py)."""
    p.add_argument("--http-port", type=startup.PORT, default=env("SPECDEC_HTTP_PORT"),
                   help="also serve the OpenAI-compatible HTTP API on this port (0 picks a free one; default: off) "
                        "[env SPECDEC_HTTP_PORT]")
    p.add_argument("--served-model-name", default=env("SPECDEC_SERVED_MODEL_NAME"),
                   help="the model id the HTTP API lists and accepts (default: the verify service's model directory name) "
                        "[env SPECDEC_SERVED_MODEL_NAME]")
    p.add_argument("--chat-template", default=env("SPECDEC_CHAT_TEMPLATE"),
                   help="Jinja chat template file for /v1/chat/completions (default: the tokenizer's own) [env SPECDEC_CHAT_TEMPLATE]")


def verify_arg(text: str) -> str:
    """--verify: HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT (replicas.parse_target)."""
    from draft_service.replicas import parse_target  # noqa: PLC0415

    name, fixed = parse_target(text)
    for a in [name] if name is not None else fixed or [""]:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"{a!r} is not HOST:PORT (a port in 1..65535)")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):  # gRPC reads ::1:PORT as another address
            raise argparse.ArgumentTypeError(f"{a!r}: an IPv6 address goes in brackets, [{host}]:{port}")
    return text


def costs_arg(text: str):
    from draft_service import calibrate  # noqa: PLC0415

    try:
        calibrate.parse_costs(text)
        return text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--costs-ms: ")) from None


def parser() -> startup.Parser:
    """The service's flags (their defaults read from the environment now)."""
    p = startup.Parser(prog="python -m draft_service", description="specdec draft service (client-facing)")
    startup.add_server_args(p, default_port=50052)
    startup.add_model_args(p)
    p.add_argument("--verify", required=True, type=verify_arg, help="verify service address, e.g. HOST:PORT or dns:///name:port")
    p.add_argument("--verify-wait-s", type=number(float, low=0), default=10.0,
                   help="how long to wait for the verify service at start-up (then NOT_SERVING until it answers)")
    p.add_argument("--verify-round-timeout-s", type=number(float, above=0), default=20.0,
                   help="a request whose verify stream takes no message or gives no verdict for this long ends with UNAVAILABLE "
                        "(the verify service stopped answering) (default: 20)")
    p.add_argument("--client-write-timeout-s", type=number(float, above=0), default=60.0,
                   help="a client that takes no chunk of its stream for this long (it stopped reading, its connection "
                        "open) is ended with DEADLINE_EXCEEDED (an HTTP stream: ended, logged as 504), and its session "
                        "with it (default: 60)")
    p.add_argument("--max-sessions", type=number(int, low=1), default=256,
                   help="requests generating at once (gRPC and HTTP together) before RESOURCE_EXHAUSTED (HTTP 429), each holding "
                        "a draft KV cache and its share of the draft's steps (>= 1; default: 256)")
    p.add_argument("--run-tokens-per-verdict", type=number(int, low=1, high=16), default=RUN_TOKENS_PER_VERDICT,
                   help="a held session's run of target-only steps asks the verify service for up to this many tokens a "
                        "verdict while it serves other sessions: fewer messages to relay, tokens streamed in bursts; 1: a "
                        f"verdict a token (default: {RUN_TOKENS_PER_VERDICT})")
    p.add_argument("--verify-tls-ca", default=env("SPECDEC_VERIFY_TLS_CA"),
                   help="CA bundle to check the verify service's certificate (enables TLS) [env SPECDEC_VERIFY_TLS_CA]")
    p.add_argument("--verify-tls-cert", default=env("SPECDEC_VERIFY_TLS_CERT"),
                   help="client certificate for mTLS to the verify service (with its key; enables TLS: without "
                        "--verify-tls-ca the verify service's certificate is checked against gRPC's default roots, not the system's "
                        "trust store) "
                        "[env SPECDEC_VERIFY_TLS_CERT]")
    p.add_argument("--verify-tls-key", default=env("SPECDEC_VERIFY_TLS_KEY"),
                   help="client key for mTLS to the verify service [env SPECDEC_VERIFY_TLS_KEY]")
    p.add_argument("--verify-auth-token-file", default=env("SPECDEC_VERIFY_AUTH_TOKEN_FILE"),
                   help="send the token in this file to the verify service (its --auth-token-file); checked at start-up "
                        "[env SPECDEC_VERIFY_AUTH_TOKEN_FILE]")
    auth.add_server_args(p)
    add_switch(p, "adaptive", True, "default for requests that do not say: choose tau (up to 8 unless the request sets "
               "num_draft_tokens) per round from the session's acceptance and the calibrated costs (default: on; it matches the "
               "best fixed tau without being told it: bench/results/POLICY.md)")
    add_switch(p, "predraft", True, "default for requests that do not say: draft round k+1 while round k is verified (default: on)")
    p.add_argument("--proposer", choices=PROPOSERS, default=env("SPECDEC_PROPOSER") or "hybrid",
                   help="default for requests that do not say: 'hybrid' (prompt lookup when a 2-gram of the text recurs, else "
                        "the draft model; the measured best: bench/results/ENGINE.md), 'draft' or 'lookup' [env SPECDEC_PROPOSER]")
    add_switch(p, "draft-fallback", True, "stop drafting with the model in a session once its measured acceptance makes "
               "speculation slower than target-only rounds, and send rounds without proposals instead (default: on; uses the "
               "calibrated costs)")
    add_switch(p, "goodput", True, "adaptive tau follows the verifier's load: each verdict says what one more proposal row "
               "costs the verifier's goodput, and a round proposes only as deep as that pays, down to none (default: on; seeded "
               "sampled requests keep load-free taus)")
    p.add_argument("--costs-ms", type=costs_arg, default=env("SPECDEC_COSTS_MS"),
                   help="pin adaptive tau's costs as 'draft_step,verify_base,verify_per_token' in ms (default: calibrated once "
                        "at start-up; pinning gives the same taus, and so the same samples, across restarts) [env SPECDEC_COSTS_MS]")
    add_http_args(p)
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    startup.check_server_args(p, args)
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--chat-template {args.chat_template}: " + ("no such file" if isinstance(e, FileNotFoundError) else
                                                                   f"cannot be read as UTF-8 text ({type(e).__name__})"))
        if args.http_port is None:  # it would do nothing: only the HTTP door renders chats
            p.error(f"--chat-template {args.chat_template}: chats are served by the HTTP door only; give --http-port too")
        from draft_service.http import check_template  # noqa: PLC0415 - before the model loads (the door checks it again)
        check_template(text, args.chat_template)
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    args.verify_token = auth.read_token(args.verify_auth_token_file, "--verify-auth-token-file") if args.verify_auth_token_file else None
    startup.check_files(args, "tls_cert", "tls_key", "tls_client_ca", "verify_tls_ca", "verify_tls_cert", "verify_tls_key")
    startup.check_model_dir(args.model)
    startup.check_port(args.host, args.port, "--port")
    startup.check_port(args.host, args.metrics_port, "--metrics-port")
    startup.check_port(args.host, args.http_port, "--http-port")

    import torch  # noqa: PLC0415 - the heavy libraries load once the cheap checks have passed

    from specdec import logs, tracing  # noqa: PLC0415

    logs.setup(args.log_format, args.log_level)
    tracing.setup("specdec.v1.Draft", args.trace)
    startup.set_threads(torch, args.threads)
    asyncio.run(run(args, token_auth))


if __name__ == "__main__":
    startup.main("python -m draft_service", main)  # the prog its flag errors name (argparse)
