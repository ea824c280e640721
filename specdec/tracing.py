"""Optional OpenTelemetry tracing: one span per request on each hop, linked across the hop by
W3C `traceparent` gRPC metadata.

Off unless a service runs with `--trace console` (or env SPECDEC_TRACE=console), which needs the
`opentelemetry-sdk` package; spans are then written to stderr as one JSON object per line. Any
other exporter (OTLP, ...) can be configured in code with `setup(..., exporter=...)`. Without
opentelemetry installed every function here is a no-op."""
from __future__ import annotations

import contextlib
import sys

import grpc

from specdec.startup import StartupError

try:
    from opentelemetry import propagate, trace
except ImportError:  # tracing is optional
    trace = propagate = None

_tracer = None


def enabled() -> bool:
    return _tracer is not None


def setup(service_name: str, mode: str | None, exporter=None) -> bool:
    """Installs a tracer provider for this process; returns whether tracing is on."""
    global _tracer
    if not mode or mode == "off":
        return False
    if trace is None:
        raise StartupError("--trace needs the opentelemetry-sdk package (pip install opentelemetry-sdk)")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:  # console: one JSON line per span on stderr, written when the span ends
        exporter = ConsoleSpanExporter(out=sys.stderr, formatter=lambda s: s.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("specdec")
    return True


@contextlib.contextmanager
def server_span(name: str, context: grpc.aio.ServicerContext, only_in_trace: bool = False, **attributes):
    """A server span, the child of the caller's span when its metadata carries one (with
    `only_in_trace`, none otherwise: the Info polls drafts make every 2 s are no trace's root).
    Yields a function that sets more attributes (a no-op when tracing is off)."""
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)} if _tracer is not None else {}
    if _tracer is None or (only_in_trace and "traceparent" not in carrier):
        yield lambda **kw: None
        return
    with _tracer.start_as_current_span(name, context=propagate.extract(carrier), kind=trace.SpanKind.SERVER) as span:
        def set_attrs(**kw):
            for k, v in kw.items():
                if v is not None:
                    span.set_attribute(k, v)
        set_attrs(**attributes)
        yield set_attrs


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for k, v in carrier.items():
        metadata.add(k, v)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class PropagateStreamStream(grpc.aio.StreamStreamClientInterceptor):
    """Adds the current span's `traceparent` to outgoing stream-stream calls (Verify.Session)."""

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list:
    return [PropagateStreamStream()] if _tracer is not None else []
