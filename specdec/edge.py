"""The RPC edge's translation table: a transport-neutral outcome (specdec/errors.py) to what gRPC
and the wire carry, and back. The core raises `RequestError(Refusal.X, ...)` and returns
`Finish.X`; only the servicers (through specdec/serving.py) and this module know their gRPC and
protobuf names."""
from __future__ import annotations

import grpc

from specdec.errors import Finish, Refusal
from specdec.v1 import specdec_pb2 as pb

_STATUS = {kind: getattr(grpc.StatusCode, kind.name) for kind in Refusal}
_KIND = {code: kind for kind, code in _STATUS.items()}
_FINISH = {Finish.NONE: pb.FINISH_REASON_UNSPECIFIED, Finish.EOS: pb.FINISH_REASON_EOS, Finish.STOP: pb.FINISH_REASON_STOP,
           Finish.LENGTH: pb.FINISH_REASON_LENGTH, Finish.CONTEXT: pb.FINISH_REASON_CONTEXT}


def status(kind: Refusal) -> grpc.StatusCode:
    """The gRPC status code a refusal ends its RPC with."""
    return _STATUS[kind]


def refusal(code: grpc.StatusCode) -> Refusal:
    """The refusal an upstream call's status stands for (INTERNAL for a code with no kind here)."""
    return _KIND.get(code, Refusal.INTERNAL)


def finish_reason(finish: Finish) -> int:
    """The proto FinishReason of a neutral Finish."""
    return _FINISH[Finish(finish)]
