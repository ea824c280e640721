"""python -m draft_service --model DIR --port P --verify HOST:PORT [--host H] ...

Flags and token files are checked before the model libraries load; any start-up failure is one
stderr line and exit code 2 (specdec/startup.py). A verify service that refuses the session
token or has another vocabulary is such a failure; one that does not answer yet is not: the
draft waits --verify-wait-s, starts NOT_SERVING, and its health follows the verify service."""
from __future__ import annotations

import argparse
import asyncio
import logging

from specdec import auth, startup
from specdec.startup import StartupError, env, env_flag, number

PROPOSERS = ("draft", "hybrid", "lookup")  # pb.Proposer's names, lower case
PROBE_INTERVAL_S = 2.0  # how often the draft checks that its verify service answers (its health)

log = logging.getLogger("specdec.draft")


def verify_channel(args):
    import grpc  # noqa: PLC0415

    from specdec import serving, tracing  # noqa: PLC0415

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
    creds = serving.channel_credentials(args.verify_tls_ca, args.verify_tls_cert, args.verify_tls_key, flag="--verify-tls")
    interceptors = tracing.client_interceptors()  # traceparent on Verify.Session when --trace is on
    interceptors += auth.metadata_interceptors(getattr(args, "verify_token", None))  # the session token on every call to the verify service
    if creds:
        return grpc.aio.secure_channel(args.verify, creds, options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(args.verify, options=opts, interceptors=interceptors)


class VerifyCheck:
    """Whether the verify service answers and takes this draft: its Info (reachable, same
    vocabulary) and an empty Verify.Session (the session token: UNAUTHENTICATED for a wrong one,
    PERMISSION_DENIED for a client token). At start-up a refusal stops the service; later the
    draft's health follows the verify service's (SERVING / NOT_SERVING), probed every
    PROBE_INTERVAL_S."""

    def __init__(self, args, channel, stub, fingerprint: str):
        self.args, self.channel, self.stub, self.fingerprint = args, channel, stub, fingerprint
        self.token_ok = False

    async def refusal(self, info) -> str | None:
        """Why the verify service that answered Info with `info` cannot serve this draft, or None."""
        import grpc  # noqa: PLC0415

        if info.vocab_fingerprint != self.fingerprint:
            return (f"--verify {self.args.verify}: the verify service has vocabulary fingerprint {info.vocab_fingerprint[:12]}, "
                    f"this draft has {self.fingerprint[:12]}: the models do not share a tokenizer")
        if not self.token_ok:
            call = self.stub.Session(metadata=[("x-request-id", "specdec-token-check")], timeout=max(1.0, self.args.verify_wait_s))
            try:
                await call.done_writing()  # no `start`: the verify service opens nothing
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # it already ended the call (a refusal): its status says why
            code = await call.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return self.token_refused(code, await call.details())
            self.token_ok = code == grpc.StatusCode.OK
        return None

    def token_refused(self, code, details: str) -> str:
        flag = "--verify-auth-token-file" + ("" if self.args.verify_auth_token_file else " (not given)")
        return f"{flag}: the verify service at {self.args.verify} refuses this draft's sessions: {code.name}: {details}"

    async def probe(self, servicer) -> str | None:
        """None if the verify service serves and takes this draft, else why not. Its health check
        (no log line there) every time; Info and the token check while the target is not yet
        known or the token not yet accepted."""
        import grpc  # noqa: PLC0415
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        from specdec.v1 import specdec_pb2 as pb  # noqa: PLC0415

        try:
            h = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                         timeout=PROBE_INTERVAL_S)
            if h.status != health_pb2.HealthCheckResponse.SERVING:
                return f"the verify service at {self.args.verify} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(h.status)}"
            if servicer.target is None or not self.token_ok:
                info = await self.stub.Info(pb.InfoRequest(), timeout=PROBE_INTERVAL_S)
                why = await self.refusal(info)
                if why:
                    return why
                servicer.set_target(info)
        except grpc.aio.AioRpcError as e:
            return f"the verify service at {self.args.verify} does not answer: {e.code().name}: {e.details()}"
        return None

    async def watch(self, servicer, set_health, serving_now: bool) -> None:
        """Runs while the service does: probes the verify service, sets the health it implies."""
        from grpc_health.v1 import health_pb2  # noqa: PLC0415

        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            why = await self.probe(servicer)
            if (why is None) != serving_now:
                serving_now = why is None
                await set_health(health_pb2.HealthCheckResponse.SERVING if serving_now else health_pb2.HealthCheckResponse.NOT_SERVING)
                log.log(logging.INFO if serving_now else logging.WARNING, "verify service " + ("answers" if serving_now else "lost"),
                        extra={"fields": {"verify": self.args.verify, **({} if serving_now else {"reason": why})}})


async def run(args, token_auth=None) -> None:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2  # noqa: PLC0415

    from draft_service import calibrate  # noqa: PLC0415
    from draft_service.server import DraftServicer  # noqa: PLC0415
    from specdec import serving  # noqa: PLC0415
    from specdec.lm import LM  # noqa: PLC0415
    from specdec.v1 import specdec_pb2 as pb  # noqa: PLC0415
    from specdec.v1 import specdec_pb2_grpc as pb_grpc  # noqa: PLC0415

    lm = LM.load(args.model, args.device, args.dtype, choices=args.engine_choices)
    channel = verify_channel(args)
    stub = pb_grpc.VerifyStub(channel)
    check = VerifyCheck(args, channel, stub, lm.fingerprint)
    target = None
    try:
        target = await stub.Info(pb.InfoRequest(), timeout=args.verify_wait_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise StartupError(check.token_refused(e.code(), e.details())) from None
        log.warning("verify service not reachable yet; NOT_SERVING until it answers", extra={"fields": {"verify": args.verify, "code": e.code().name}})
    if target is not None:
        why = await check.refusal(target)
        if why:
            raise StartupError(why)
    servicer = DraftServicer(lm, stub, target, adaptive=args.adaptive, predraft=args.predraft, proposer=pb.Proposer.Value(f"PROPOSER_{args.proposer.upper()}"),
                             costs=calibrate.parse_costs(args.costs_ms) if args.costs_ms else None,
                             round_timeout_s=args.verify_round_timeout_s)
    if target is not None and args.adaptive:
        await servicer.costs()  # calibrate now, not at the first request
    tasks = set()

    def on_start(set_health):
        tasks.add(asyncio.get_running_loop().create_task(check.watch(servicer, set_health, target is not None)))

    ready = health_pb2.HealthCheckResponse.SERVING if target is not None else health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        await serving.serve(args, "specdec.v1.Draft", lambda s: pb_grpc.add_DraftServicer_to_server(servicer, s), interceptors=[token_auth],
                            ready=ready, on_start=on_start)
    finally:
        for t in tasks:
            t.cancel()
        await channel.close()


def costs_arg(text: str):
    from draft_service import calibrate  # noqa: PLC0415

    try:
        calibrate.parse_costs(text)
        return text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--costs-ms: ")) from None


def main(argv=None) -> None:
    p = startup.Parser(prog="python -m draft_service", description="specdec draft service (client-facing)")
    startup.add_server_args(p, default_port=50052)
    startup.add_model_args(p)
    p.add_argument("--verify", required=True, help="verify service address, e.g. HOST:PORT or dns:///name:port")
    p.add_argument("--verify-wait-s", type=number(float, low=0), default=10.0,
                   help="how long to wait for the verify service at start-up (then NOT_SERVING until it answers)")
    p.add_argument("--verify-round-timeout-s", type=number(float, above=0), default=20.0,
                   help="a request whose verify stream takes no message or gives no verdict for this long ends with UNAVAILABLE "
                        "(the verify service stopped answering) (default: 20)")
    p.add_argument("--verify-tls-ca", default=env("SPECDEC_VERIFY_TLS_CA"),
                   help="CA bundle to check the verify service's certificate (enables TLS) [env SPECDEC_VERIFY_TLS_CA]")
    p.add_argument("--verify-tls-cert", default=env("SPECDEC_VERIFY_TLS_CERT"),
                   help="client certificate for mTLS to the verify service [env SPECDEC_VERIFY_TLS_CERT]")
    p.add_argument("--verify-tls-key", default=env("SPECDEC_VERIFY_TLS_KEY"),
                   help="client key for mTLS to the verify service [env SPECDEC_VERIFY_TLS_KEY]")
    p.add_argument("--verify-auth-token-file", default=env("SPECDEC_VERIFY_AUTH_TOKEN_FILE"),
                   help="send the token in this file to the verify service (its --auth-token-file); checked at start-up "
                        "[env SPECDEC_VERIFY_AUTH_TOKEN_FILE]")
    auth.add_server_args(p)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=env_flag("SPECDEC_ADAPTIVE", True),
                   help="default for requests that do not say: choose tau (up to 8 unless the request sets num_draft_tokens) "
                        "per round from the session's acceptance and the calibrated costs (default: on; it matches the best fixed tau "
                        "without being told it: bench/results/POLICY.md) [env SPECDEC_ADAPTIVE]")
    p.add_argument("--predraft", action=argparse.BooleanOptionalAction, default=env_flag("SPECDEC_PREDRAFT", True),
                   help="default for requests that do not say: draft round k+1 while round k is verified (default: on) "
                        "[env SPECDEC_PREDRAFT]")
    p.add_argument("--proposer", choices=PROPOSERS, default=env("SPECDEC_PROPOSER") or "hybrid",
                   help="default for requests that do not say: 'hybrid' (prompt lookup when a 2-gram of the text recurs, else "
                        "the draft model; the measured best: bench/results/ENGINE.md), 'draft' or 'lookup' [env SPECDEC_PROPOSER]")
    p.add_argument("--costs-ms", type=costs_arg, default=env("SPECDEC_COSTS_MS"),
                   help="pin adaptive tau's costs as 'draft_step,verify_base,verify_per_token' in ms (default: calibrated once "
                        "at start-up; pinning gives the same taus, and so the same samples, across restarts) [env SPECDEC_COSTS_MS]")
    args = p.parse_args(argv)
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    args.verify_token = auth.read_token(args.verify_auth_token_file, "--verify-auth-token-file") if args.verify_auth_token_file else None
    startup.check_model_dir(args.model)
    startup.check_port(args.host, args.port, "--port")
    startup.check_port(args.host, args.metrics_port, "--metrics-port")

    import torch  # noqa: PLC0415 - the heavy libraries load once the cheap checks have passed

    from specdec import logs, tracing  # noqa: PLC0415

    logs.setup(args.log_format, args.log_level)
    tracing.setup("specdec.v1.Draft", args.trace)
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(run(args, token_auth))


if __name__ == "__main__":
    startup.main("draft_service", main)
