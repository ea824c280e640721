"""Transport-neutral outcomes of a request: a refusal (`RequestError`, of a `Refusal` kind) and the
reason a generation ended (`Finish`). Nothing here knows gRPC or the wire format: the RPC edge
(specdec/edge.py) maps a Refusal to a gRPC status code and a Finish to the proto's FinishReason."""
from __future__ import annotations

import enum


class Refusal(enum.Enum):
    """Why a request was refused or ended early; named after the gRPC codes they map to."""
    INVALID_ARGUMENT = "invalid argument"
    FAILED_PRECONDITION = "failed precondition"
    RESOURCE_EXHAUSTED = "resource exhausted"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline exceeded"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission denied"
    INTERNAL = "internal"


class Finish(enum.IntEnum):
    """Why a sequence ended; NONE (false) while it goes on."""
    NONE = 0
    EOS = 1
    STOP = 2  # a stop string (the text layer decides this one)
    LENGTH = 3
    CONTEXT = 4


class RequestError(Exception):
    def __init__(self, kind: Refusal, message: str, retry: bool = True):
        """retry: whether the same request may succeed later on the same service (False: a
        RESOURCE_EXHAUSTED that no wait cures, such as a request larger than the whole cache budget)."""
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry = retry


def invalid(message: str) -> RequestError:
    return RequestError(Refusal.INVALID_ARGUMENT, message)
