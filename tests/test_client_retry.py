"""The retry policy shared by the blocking and the asyncio client (client/core.py), in-process."""
import grpc
import pytest

from client.core import _Attempts, _Target


class Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def targets(fallback=True):
    out = [_Target("draft", "draft-stub", [("authorization", "Bearer c")])]
    return out + ([_Target("verify", "verify-stub", [("authorization", "Bearer f")])] if fallback else [])


def test_primary_retried_then_fallback_with_its_own_metadata_and_growing_delays():
    attempts = _Attempts(targets(), retries=2)
    seen = []
    for delay, t in attempts:
        seen.append((delay, t.label, t.metadata[0][1]))
        if t.label == "draft":
            attempts.failed(Err(grpc.StatusCode.UNAVAILABLE))
    assert seen == [(0.0, "draft", "Bearer c"), (0.1, "draft", "Bearer c"), (0.2, "draft", "Bearer c"), (0.4, "verify", "Bearer f")]


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED])
def test_other_errors_are_not_retried(code):
    attempts = _Attempts(targets(), retries=3)
    for _, t in attempts:
        with pytest.raises(Err):
            attempts.failed(Err(code))
        break


def test_the_last_attempt_raises():
    attempts = _Attempts(targets(fallback=False), retries=1)
    labels = []
    with pytest.raises(Err):
        for _, t in attempts:
            labels.append(t.label)
            attempts.failed(Err(grpc.StatusCode.UNAVAILABLE))
    assert labels == ["draft", "draft"]
