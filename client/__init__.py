"""specdec client: `Client` (blocking) and `AsyncClient` (asyncio) for the draft service, or for
the verify service with target_only=True. Depends on grpcio and protobuf only."""
from .core import AsyncClient, Client, Result, StreamError, make_request

__all__ = ["AsyncClient", "Client", "Result", "StreamError", "make_request"]
