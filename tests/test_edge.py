"""The RPC edge's translation table (specdec/edge.py): every transport-neutral outcome has its
gRPC / wire name, and an upstream status comes back as the same refusal."""
import grpc
import pytest

from specdec import edge
from specdec.errors import Finish, Refusal
from specdec.v1 import specdec_pb2 as pb


@pytest.mark.parametrize("kind", list(Refusal))
def test_every_refusal_has_its_status_and_round_trips(kind):
    code = edge.status(kind)
    assert isinstance(code, grpc.StatusCode) and code.name == kind.name
    assert edge.refusal(code) is kind


def test_a_status_with_no_refusal_of_its_own_is_internal():
    assert edge.refusal(grpc.StatusCode.DATA_LOSS) is Refusal.INTERNAL


def test_finish_reasons_map_onto_the_proto_enum():
    assert [pb.FinishReason.Name(edge.finish_reason(f)) for f in Finish] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_EOS", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_CONTEXT"]
    assert not Finish.NONE and all(f for f in Finish if f is not Finish.NONE)  # "has it ended" stays a truth test
