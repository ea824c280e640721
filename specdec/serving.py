"""gRPC server plumbing shared by both services: options, TLS, health, reflection, errors, the
interceptors (per-request observability from specdec/observe.py first, then bearer-token auth
from specdec/auth.py when configured), the `listening on HOST:PORT` line, and a graceful drain
on SIGTERM/SIGINT.

TLS file flags also read environment variables (a flag wins): SPECDEC_TLS_CERT, SPECDEC_TLS_KEY,
SPECDEC_TLS_CLIENT_CA on both servers. Messages larger than --max-message-bytes are refused by
gRPC itself with RESOURCE_EXHAUSTED."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from specdec import edge, metrics, observe, tracing, vocabdiff
from specdec.startup import StartupError, add_server_args, env, env_flag, read_file  # noqa: F401 - the services' flags
from specdec.errors import Refusal, RequestError
from specdec.observe import REQUEST_ID_KEY, RequestObserver  # noqa: F401 - REQUEST_ID_KEY: the servicers use it
from specdec.v1 import specdec_pb2 as pb

log = logging.getLogger("specdec.serving")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), so the `serving` line says how long the
    start-up took, imports and the engine's load-time choices included; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, counted from field 3
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED: when to try again
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # the same, read by gRPC's own retry policy (client.core.retry_service_config)
RETRY_AFTER_MS = 1000
MODES = [pb.PROPOSAL_MODE_GREEDY, pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_DENSE]


def model_info(lm, include_vocab: bool = False, architectures: tuple[str, ...] = ()) -> pb.ModelInfo:
    """What Info answers; `include_vocab` adds every token (to explain a fingerprint mismatch);
    `architectures`: the ones the engine serves (the servicer passes the engine's list)."""
    return pb.ModelInfo(
        model_name=lm.name,
        vocab_fingerprint=lm.fingerprint,
        vocab_size=lm.vocab_size,
        max_context=lm.max_context,
        proposal_modes=MODES,
        num_parameters=lm.num_parameters,
        eos_token_id=-1 if lm.eos_token_id is None else lm.eos_token_id,
        eos_token_ids=sorted(lm.eos),
        device=str(lm.device),
        dtype=str(lm.dtype).removeprefix("torch."),
        supported_architectures=architectures,
        tokenizer=vocabdiff.tokenizer_info(lm.tokenizer, include_vocab),
    )


def _read(path: str | None, flag: str = "file") -> bytes | None:
    return read_file(path, flag) if path else None


def server_credentials(args) -> grpc.ServerCredentials | None:
    if not args.tls_cert:
        if args.tls_key or args.tls_client_ca:
            raise StartupError("--tls-key/--tls-client-ca need --tls-cert")
        return None
    if not args.tls_key:
        raise StartupError("--tls-cert needs --tls-key")
    ca = _read(args.tls_client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([(_read(args.tls_key, "--tls-key"), _read(args.tls_cert, "--tls-cert"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None, flag: str = "--tls") -> grpc.ChannelCredentials | None:
    """TLS where a CA or a client certificate is given (a certificate without a CA: against gRPC's
    default roots, not the system's trust store, as the client library does); the certificate and
    key go together."""
    if bool(cert) != bool(key):
        raise StartupError(f"{flag}-cert and {flag}-key go together")
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, f"{flag}-ca"), private_key=_read(key, f"{flag}-key"),
                                        certificate_chain=_read(cert, f"{flag}-cert"))


def link_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The gRPC options both ends of a service link share: the message size limit both ways and
    keepalive pings (a dead peer is noticed in about a minute: 30 s to the first ping, 10 s for its
    answer; 61-64 s measured through a proxy that stopped forwarding)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def server_options(args) -> list[tuple[str, int]]:
    opts = link_options(args.max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),  # gRPC's default is on: a second server on the port would share its connections
    ]
    if args.max_connection_age_s:  # no new streams on an older connection (its clients re-resolve); running ones go on
        opts.append(("grpc.max_connection_age_ms", int(args.max_connection_age_s * 1000)))
        if args.max_connection_age_grace_s is not None:  # gRPC's default: until they end
            opts.append(("grpc.max_connection_age_grace_ms", int(args.max_connection_age_grace_s * 1000)))
    return opts


def request_id(context: grpc.aio.ServicerContext, fallback: str = "") -> str:
    return observe.request_id(context.invocation_metadata(), fallback)


# what gRPC core (not the verify service) says of a connection that went away
TRANSPORT = re.compile(r"Socket closed|Cancelling all calls|Stream removed|Connection reset|Broken pipe|GOAWAY|recvmsg|"
                       r"failed to connect|Connection refused|connections to all backends failed", re.IGNORECASE)


async def upstream_error(e: Exception, call) -> Exception:
    """The upstream call's own status when it has ended: a write on a stream the peer already
    closed raises InvalidStateError (or a bare core error), not the status the peer sent."""
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (e.debug_error_string() or ""):
        # grpc aio overwrites the peer's status with this when a write races the peer ending the
        # stream (grpc/grpc issue 36066): the request was not served, so it is safe to retry
        return RequestError(Refusal.UNAVAILABLE, "upstream: the verify service ended the session while a message was in flight "
                            "(its status was lost, grpc/grpc#36066); retry")
    if isinstance(e, grpc.aio.AioRpcError) and e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # a unary call of this service's (a pairing check's Info) refused for its own credential: as below
        return RequestError(Refusal.UNAVAILABLE, f"upstream refused this service's credentials ({e.code().name}): {e.details()}")
    if call is None or isinstance(e, RequestError) or not call.done():
        return e
    try:
        code = await call.code()
        if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            return e
        final = dict(await call.trailing_metadata() or ()).get(PUSHBACK_KEY) == "-1"  # the upstream said no retry cures it
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):  # this service's own credential, not
            # the caller's (a token rotated upstream): the service cannot serve now, so the caller may retry or fall back
            return RequestError(Refusal.UNAVAILABLE, f"upstream refused this service's credentials ({code.name}): "
                                f"{await call.details()}")
        details = " ".join(str(await call.details()).split())
        if code == grpc.StatusCode.UNAVAILABLE and TRANSPORT.search(details):  # gRPC core's own words say little
            details = f"the verify service is unavailable: it shut down or the connection to it was lost ({details})"
        return RequestError(edge.refusal(code), f"upstream: {details}", retry=not final)
    except Exception:  # noqa: BLE001 - an intercepted call re-raises what failed it (a closed channel's UsageError)
        return e


async def release(call) -> None:
    """Ends an upstream bidirectional call for good: cancels it if it still runs, then closes its
    request side. On a channel with interceptors (the session token, tracing) grpc.aio feeds
    `write` through a queue that a task of the call drains; when the PEER ends the call, cancel()
    is a no-op and that task waits on the queue forever, one leaked task (and a "Task was
    destroyed but it is pending" error when it is collected) per call that the verify service
    ended or refused (grpc/grpc pull request 37355, not merged). done_writing() ends that queue."""
    call.cancel()
    try:
        await call.done_writing()
    except Exception:  # noqa: BLE001 - a cancelled or finished call may refuse it; the queue is closed either way or was never used
        pass


async def fail(context: grpc.aio.ServicerContext, service: str, method: str, e: Exception, upstream=None):
    """Ends the RPC with the status an exception stands for (INTERNAL for the unexpected): the
    one place a transport-neutral refusal becomes a gRPC status (specdec/edge.py).
    `upstream`: the call this handler made, whose status explains a failed write or read.
    (The error is counted and logged by the request observer, specdec/observe.py.)"""
    e = await upstream_error(e, upstream)
    if context.cancelled() and not isinstance(e, RequestError):
        # the caller is gone (cancelled, deadline, connection lost): a write to it failed; no one to tell
        log.debug("%s: caller gone: %s: %s", method, type(e).__name__, e)
        return
    if isinstance(e, RequestError):
        code, msg = edge.status(e.kind), e.message
    elif isinstance(e, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        code, msg = e.code(), f"upstream: {e.details()}"
    else:
        log.exception("internal error in %s", method)
        code, msg = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        if isinstance(e, RequestError) and not e.retry:  # a negative pushback: gRPC's retry policy does not retry
            context.set_trailing_metadata(((PUSHBACK_KEY, "-1"),))
        else:
            # retry-after-ms for people and our own tools; grpc-retry-pushback-ms for gRPC's retry policy (a
            # full service, or one whose upstream is restarting: retries spaced a second apart outlast a restart)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(RETRY_AFTER_MS)), (PUSHBACK_KEY, str(RETRY_AFTER_MS))))
    await context.abort(code, msg)


def bracketed(host: str) -> str:
    """An IPv6 --host as an address names it, [::1]: gRPC read ::1:PORT as another address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(args, service_name: str, add_servicer, interceptors=(), on_stop=None, ready=None, on_start=None, http=None) -> None:
    """Starts the server, prints `listening on HOST:PORT`, runs until SIGTERM/SIGINT, drains.
    `interceptors` (None entries skipped) run after the request observer, which sees every call.
    A port that cannot be bound is a StartupError (before `listening on`). `ready`: the health
    status of `service_name` to start with (default SERVING); `on_start(set_health)` is called once
    serving, with a coroutine function that sets it (the draft follows its verify service) and,
    given `liveness=STATUS`, the whole server's status ("", what liveness probes check) (a verify
    service whose passes keep faulting); else "" is SERVING until the drain.
    `http`: a front door served beside it in this event loop (async `start()`, which prints its
    own address line, and `stop()`, which drains it; draft_service/http.py)."""
    if getattr(args, "trace", "off") != "off" and not tracing.enabled():
        tracing.setup(service_name, args.trace)
    observer = RequestObserver(service_name.rsplit(".", 1)[-1].lower())
    server = grpc.aio.server(options=server_options(args), interceptors=[observer, *(i for i in interceptors if i is not None)])
    add_servicer(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([service_name, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)
    host = bracketed(args.host)
    address = f"{host}:{args.port}"
    creds = server_credentials(args)
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # grpc raises (older versions return 0) when it cannot bind
        port = 0
    if not port:  # the port was free a moment ago (specdec/startup.check_port): taken since, or TLS material gRPC refused
        why = "are --tls-cert and --tls-key a matching PEM certificate and key? or the" if creds else "the"
        raise StartupError(f"--port {args.port}: gRPC cannot listen on {address} ({why} address is in use or not of this host)")
    try:
        mport = metrics.serve_metrics(args.metrics_port, args.host, service_name.rsplit(".", 1)[-1].lower())
    except OSError as e:
        raise StartupError(f"--metrics-port {args.metrics_port}: cannot listen on {args.host}:{args.metrics_port}: {e.strerror or e}") from None
    if http is not None:
        http.bind()  # before the gRPC server starts: a port taken since the start-up check is one line, exit 2
    stop = asyncio.Event()  # SIGTERM from here on is the drain (before, startup.main's one-line exit): set before the
    loop = asyncio.get_running_loop()  # server starts, so a signal that lands as it starts drains it
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()

    async def set_health(status, liveness=None) -> None:  # the service's own name (readiness); with liveness, a status
        await health.set(service_name, status)  # for "" (the whole server: what liveness probes check) too
        if liveness is not None:
            await health.set("", liveness)

    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await set_health(health_pb2.HealthCheckResponse.SERVING if ready is None else ready)
    if on_start:
        on_start(set_health)  # the service reports its own health from now on
    if mport is not None:
        print(f"metrics on {host}:{mport}", flush=True)
    if http is not None:
        await http.start()
    print(f"listening on {host}:{port}", flush=True)
    log.info("serving", extra={"fields": {"address": f"{host}:{port}", "metrics_port": mport, "service": service_name,
                                          "startup_s": process_age_s()}})

    await stop.wait()
    log.info("draining", extra={"fields": {"grace_s": args.drain_s}})
    await health.enter_graceful_shutdown()  # orchestrators stop routing here at once
    observer.cut_at = time.monotonic() + args.drain_s  # streams still running then are cut: UNAVAILABLE to their callers
    # new RPCs (and HTTP requests) refused; running streams get the grace period
    await asyncio.gather(server.stop(args.drain_s), *([http.stop()] if http is not None else []))
    if on_stop:
        on_stop()
    log.info("stopped")
