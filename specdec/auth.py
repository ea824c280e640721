"""Bearer-token authentication, both ends.

Server side: `TokenAuth`, a grpc.aio server interceptor. A call must carry
`authorization: Bearer <token>` metadata with one of the configured tokens, else it ends with
UNAUTHENTICATED; a token that is known but not allowed the method ends with PERMISSION_DENIED.
Tokens are compared in constant time (hmac.compare_digest, against every configured token).
Health checking and reflection are exempt. The refusal is logged once, by the request observer
(specdec/observe.py), which logs the reason and the peer but never a token.

Who holds which token (flags on the services, tokens read from files):
  verify --auth-token-file     the session token: every Verify RPC (the draft service holds it,
                               as --verify-auth-token-file)
  verify --client-token-file   the client token: Verify.Generate and Verify.Info only (clients
                               falling back to the verify service); Session gets PERMISSION_DENIED
  draft  --auth-token-file     the client token of the draft: every Draft RPC

Client side: `metadata_interceptors(token)`, grpc.aio channel interceptors that add the header
to every call of a channel (the draft's channel to the verify service)."""
from __future__ import annotations

import argparse
import hmac
import os

import grpc

from specdec import edge
from specdec.errors import Refusal
from specdec.files import StartupError, read_token  # noqa: F401 - read_token: the services' token flags

EXEMPT = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # orchestrators and tooling need no token
CLIENT_METHODS = frozenset({"Generate", "Info"})  # what a client token may call on the verify service


def header(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def add_server_args(p: argparse.ArgumentParser, client_tokens: bool = False) -> None:
    """--auth-token-file (and, for the verify service, --client-token-file)."""
    p.add_argument("--auth-token-file", default=_env("SPECDEC_AUTH_TOKEN_FILE"),
                   help="require `authorization: Bearer <token>` metadata with the token in this file on every RPC "
                        "(health checks and reflection exempt) [env SPECDEC_AUTH_TOKEN_FILE]")
    if client_tokens:
        p.add_argument("--client-token-file", default=_env("SPECDEC_CLIENT_TOKEN_FILE"),
                       help="also accept the token in this file, for Generate and Info only (clients using the verify "
                            "service as a fallback); it gets PERMISSION_DENIED on Session. Needs --auth-token-file "
                            "[env SPECDEC_CLIENT_TOKEN_FILE]")


def server_interceptor(args) -> TokenAuth | None:
    """The interceptor the parsed flags ask for (None: no authentication). Reads the token
    files now, so a missing or empty file stops the service at start-up."""
    client_file = getattr(args, "client_token_file", None)
    if not args.auth_token_file:
        if client_file:
            raise StartupError("--client-token-file needs --auth-token-file (the token that may open sessions)")
        return None
    grants = [(read_token(args.auth_token_file, "--auth-token-file"), None)]
    if client_file:
        client = read_token(client_file, "--client-token-file")
        if hmac.compare_digest(client.encode(), grants[0][0].encode()):
            raise StartupError("--client-token-file and --auth-token-file hold the same token")
        grants.append((client, CLIENT_METHODS))
    return TokenAuth(grants)


class TokenAuth(grpc.aio.ServerInterceptor):
    """grants: [(token, method names it may call, or None for all)]."""

    def __init__(self, grants: list[tuple[str, frozenset[str] | None]]):
        self._grants = [(f"Bearer {t}".encode(), allowed) for t, allowed in grants]

    def check(self, method_path: str, metadata) -> tuple[Refusal, str] | None:
        """None if the call may go on, else the refusal and reason to refuse it with."""
        if method_path.startswith(EXEMPT):
            return None
        got = b""
        for k, v in metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else v
        if got[:7].lower() == b"bearer ":  # the scheme's name is case-insensitive (RFC 7235)
            got = b"Bearer " + got[7:]
        if not got:
            return Refusal.UNAUTHENTICATED, "missing bearer token"
        allowed, matched = None, False
        for want, methods in self._grants:  # compare with every token: the time says nothing about which matched
            if hmac.compare_digest(got, want):
                allowed, matched = methods, True
        if not matched:
            return Refusal.UNAUTHENTICATED, "invalid bearer token"
        method = method_path.rsplit("/", 1)[-1]
        if allowed is not None and method not in allowed:
            return Refusal.PERMISSION_DENIED, f"this token may not call {method}"
        return None

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        refusal = self.check(details.method, details.invocation_metadata)
        handler = await continuation(details)
        if refusal is None or handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        code, reason = edge.status(refusal[0]), refusal[1]

        async def deny(request, context):
            await context.abort(code, reason)

        deny.refuses = True  # the request observer leaves its request unread: an undecodable one is refused as this caller

        # a coroutine handler of the same kind (and codecs) as the real one, which only aborts
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        return kind[handler.request_streaming, handler.response_streaming](
            deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


# ---- client side ----------------------------------------------------------------------------------

def _with_header(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != "authorization"])
    metadata.add(*header(token))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _Token:
    def __init__(self, token: str):
        self.token = token


class _UnaryUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_header(details, self.token), request)


class _UnaryStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_header(details, self.token), request)


class _StreamStream(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_header(details, self.token), request_iterator)


def metadata_interceptors(token: str | None) -> list:
    """grpc.aio channel interceptors that send `authorization: Bearer <token>` on every unary
    and streaming call (grpc.aio files each interceptor under one call kind, hence three)."""
    if not token:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamStream(token)]
