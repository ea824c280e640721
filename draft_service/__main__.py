"""python -m draft_service --model DIR --port P --verify HOST:PORT [--host H] ..."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import grpc
import torch

from specdec import auth, logs, serving, tracing
from specdec.lm import LM, Unsupported, add_model_args
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from draft_service import calibrate, http
from draft_service.server import DraftServicer, pairing_error

PROPOSERS = {name.removeprefix("PROPOSER_").lower(): value for name, value in pb.Proposer.items() if value}

log = logging.getLogger("specdec.draft")


def verify_channel(args) -> grpc.aio.Channel:
    opts = [
        ("grpc.lb_policy_name", "round_robin"),  # spread sessions over all resolved verify replicas
        ("grpc.max_receive_message_length", args.max_message_bytes),
        ("grpc.max_send_message_length", args.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # reconnect soon after a verify restart (gRPC's default backoff grows to 120 s)
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
    creds = serving.channel_credentials(args.verify_tls_ca, args.verify_tls_cert, args.verify_tls_key)
    interceptors = tracing.client_interceptors()  # traceparent on Verify.Session when --trace is on
    interceptors += auth.metadata_interceptors(getattr(args, "verify_token", None))  # the session token on every call to the verify service
    if creds:
        return grpc.aio.secure_channel(args.verify, creds, options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(args.verify, options=opts, interceptors=interceptors)


async def run(args, token_auth=None) -> None:
    try:
        lm = LM.load(args.model, args.device, args.dtype, choices=args.engine_choices)
    except Unsupported as e:
        print(f"draft_service: {e}", file=sys.stderr)
        sys.exit(2)
    channel = verify_channel(args)
    stub = pb_grpc.VerifyStub(channel)
    target = None
    try:
        target = await stub.Info(pb.InfoRequest(), timeout=args.verify_wait_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as e:
        log.warning("verify service not reachable yet; sessions will check it", extra={"fields": {"verify": args.verify, "code": e.code().name}})
    problem = await pairing_error(stub, lm, target) if target is not None else None
    if problem:
        print(f"error: verify service at {args.verify}: {problem}", file=sys.stderr)
        sys.exit(2)
    servicer = DraftServicer(lm, stub, target, adaptive=args.adaptive, predraft=args.predraft, proposer=PROPOSERS[args.proposer],
                             draft_fallback=args.draft_fallback, goodput=args.goodput,
                             costs=calibrate.parse_costs(args.costs_ms) if args.costs_ms else None)
    if target is not None and (args.adaptive or args.draft_fallback):
        await servicer.costs()  # calibrate now, not at the first request
    front = None
    if args.http_port >= 0:
        front = http.FrontDoor(servicer, args, token_auth, model=target.model_name if target is not None else lm.name)
    await serving.serve(args, "specdec.v1.Draft", lambda s: pb_grpc.add_DraftServicer_to_server(servicer, s), interceptors=[token_auth],
                        http=front)
    await channel.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m draft_service", description="specdec draft service (client-facing)")
    serving.add_server_args(p, default_port=50052)
    add_model_args(p)
    p.add_argument("--verify", required=True, help="verify service address, e.g. HOST:PORT or dns:///name:port")
    p.add_argument("--verify-wait-s", type=float, default=10.0, help="how long to wait for the verify service at start-up")
    env = serving.env
    p.add_argument("--verify-tls-ca", default=env("SPECDEC_VERIFY_TLS_CA"),
                   help="CA bundle to check the verify service's certificate (enables TLS) [env SPECDEC_VERIFY_TLS_CA]")
    p.add_argument("--verify-tls-cert", default=env("SPECDEC_VERIFY_TLS_CERT"),
                   help="client certificate for mTLS to the verify service [env SPECDEC_VERIFY_TLS_CERT]")
    p.add_argument("--verify-tls-key", default=env("SPECDEC_VERIFY_TLS_KEY"),
                   help="client key for mTLS to the verify service [env SPECDEC_VERIFY_TLS_KEY]")
    p.add_argument("--verify-auth-token-file", default=env("SPECDEC_VERIFY_AUTH_TOKEN_FILE"),
                   help="send the token in this file to the verify service (its --auth-token-file) "
                        "[env SPECDEC_VERIFY_AUTH_TOKEN_FILE]")
    auth.add_server_args(p)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=serving.env_flag("SPECDEC_ADAPTIVE", True),
                   help="default for requests that do not say: choose tau (up to 8 unless the request sets num_draft_tokens) "
                        "per round from the session's acceptance and the calibrated costs (default: on; it matches the best fixed tau "
                        "without being told it: bench/results/POLICY.md) [env SPECDEC_ADAPTIVE]")
    p.add_argument("--predraft", action=argparse.BooleanOptionalAction, default=serving.env_flag("SPECDEC_PREDRAFT", True),
                   help="default for requests that do not say: draft round k+1 while round k is verified (default: on) "
                        "[env SPECDEC_PREDRAFT]")
    p.add_argument("--proposer", choices=sorted(PROPOSERS), default=serving.env("SPECDEC_PROPOSER") or "hybrid",
                   help="default for requests that do not say: 'hybrid' (prompt lookup when a 2-gram of the text recurs, else "
                        "the draft model; the measured best: bench/results/ENGINE.md), 'draft' or 'lookup' [env SPECDEC_PROPOSER]")
    p.add_argument("--draft-fallback", action=argparse.BooleanOptionalAction, default=serving.env_flag("SPECDEC_DRAFT_FALLBACK", True),
                   help="stop drafting with the model in a session once its measured acceptance makes speculation slower than "
                        "target-only rounds, and send rounds without proposals instead (default: on; uses the calibrated costs) "
                        "[env SPECDEC_DRAFT_FALLBACK]")
    p.add_argument("--goodput", action=argparse.BooleanOptionalAction, default=serving.env_flag("SPECDEC_GOODPUT", True),
                   help="adaptive tau follows the verifier's load: each verdict says what one more proposal row costs the "
                        "verifier's goodput, and a round proposes only as deep as that pays, down to none (default: on; "
                        "seeded sampled requests keep load-free taus) [env SPECDEC_GOODPUT]")
    p.add_argument("--costs-ms", default=serving.env("SPECDEC_COSTS_MS"),
                   help="pin adaptive tau's costs as 'draft_step,verify_base,verify_per_token' in ms (default: calibrated once "
                        "at start-up; pinning gives the same taus, and so the same samples, across restarts) [env SPECDEC_COSTS_MS]")
    http.add_args(p)
    args = p.parse_args(argv)
    if args.chat_template and not os.path.isfile(args.chat_template):
        p.error(f"--chat-template {args.chat_template}: no such file")
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    args.verify_token = auth.read_token(args.verify_auth_token_file) if args.verify_auth_token_file else None
    logs.setup(args.log_format, args.log_level)
    tracing.setup("specdec.v1.Draft", args.trace)
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(run(args, token_auth))


if __name__ == "__main__":
    main()
