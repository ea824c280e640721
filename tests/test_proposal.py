"""The proposal codec round-trips in every mode, and decode_round refuses what the wire must not carry."""
import pytest
import torch

from specdec.errors import RequestError
from specdec.proposal import Proposal, decode_round
from specdec.sampling import sparsify
from specdec.v1 import specdec_pb2 as pb

V = 7


def _q(seed):
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2, -1)


def _decode(r, mode, greedy=False, expected=1, room=100):
    """(tokens, q as a [tau, V] table, or None): decode_round's RoundQ as the pass's table holds it."""
    tokens, q = decode_round(r, expected=expected, room=room, vocab_size=V, mode=mode, greedy=greedy)
    return tokens, None if q is None else q.dense(V)


@pytest.mark.parametrize("mode", [pb.PROPOSAL_MODE_DENSE, pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_GREEDY])
def test_round_trip(mode):
    prop, want = Proposal(), []
    for i, x in enumerate([3, 1, 5]):
        q = _q(i)
        if mode == pb.PROPOSAL_MODE_DENSE:
            prop.add(x, mode, q)
            want.append(q)
        elif mode == pb.PROPOSAL_MODE_SPARSE:
            ids, vals = sparsify(q, 4)
            x = int(ids[0])
            prop.add(x, mode, vals, ids)
            want.append(torch.zeros(V).index_put_((ids,), vals))
        else:
            prop.add(x, mode)
            want.append(torch.nn.functional.one_hot(torch.tensor(x), V).float())
    r = prop.to_round(1)
    tokens, q = _decode(pb.Round.FromString(r.SerializeToString()), mode)  # through the wire bytes
    assert tokens.tolist() == prop.tokens
    torch.testing.assert_close(q, torch.stack(want), rtol=0, atol=1e-7)  # float32 on the wire
    assert _decode(r, mode, greedy=True)[1] is None  # greedy sessions never build q
    for k in range(4):  # a chain cut to its first k proposals (a pre-draft under load) keeps each one's own q
        cut = prop.prefix(k).to_round(1)
        if k:
            tokens, q = _decode(pb.Round.FromString(cut.SerializeToString()), mode)
            assert tokens.tolist() == prop.tokens[:k]
            torch.testing.assert_close(q, torch.stack(want[:k]), rtol=0, atol=1e-7)
        else:
            assert list(cut.tokens) == [] and list(cut.q_probs) == [] and list(cut.q_ids) == []


def test_one_hot_lookup_proposals_in_every_mode():
    for mode in (pb.PROPOSAL_MODE_DENSE, pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_GREEDY):
        tokens, q = _decode(Proposal.one_hot([2, 6], mode, V).to_round(1), mode)
        assert tokens.tolist() == [2, 6] and torch.equal(q, torch.nn.functional.one_hot(torch.tensor([2, 6]), V).float())


BAD = [
    (pb.Round(round=2, tokens=[1]), pb.PROPOSAL_MODE_GREEDY, "round: expected 1"),
    (pb.Round(round=1, tokens=[1, 2, 3]), pb.PROPOSAL_MODE_GREEDY, "at most 2 fit"),  # room=2 below
    (pb.Round(round=1, tokens=[V]), pb.PROPOSAL_MODE_GREEDY, "outside the vocabulary"),
    (pb.Round(round=1, tokens=[1], q_probs=[1.0]), pb.PROPOSAL_MODE_GREEDY, "sends no probabilities"),
    (pb.Round(round=1, tokens=[1], q_probs=[1.0] * (V - 1)), pb.PROPOSAL_MODE_DENSE, "dense mode needs"),
    (pb.Round(round=1, tokens=[1], q_counts=[2], q_ids=[1], q_probs=[1.0]), pb.PROPOSAL_MODE_SPARSE, "lengths disagree"),
    (pb.Round(round=1, tokens=[1], q_counts=[2], q_ids=[1, 1], q_probs=[0.5, 0.5]), pb.PROPOSAL_MODE_SPARSE, "repeats"),
    (pb.Round(round=1, tokens=[1], q_counts=[1], q_ids=[1], q_probs=[0.5]), pb.PROPOSAL_MODE_SPARSE, "sum to 1"),
    (pb.Round(round=1, tokens=[1], q_counts=[1], q_ids=[2], q_probs=[1.0]), pb.PROPOSAL_MODE_SPARSE, "no probability in its q"),
    (pb.Round(round=1, tokens=[1], q_counts=[1], q_ids=[1], q_probs=[float("nan")]), pb.PROPOSAL_MODE_SPARSE, "finite"),
]


@pytest.mark.parametrize("r,mode,why", BAD)
def test_bad_rounds_are_refused_naming_the_field(r, mode, why):
    with pytest.raises(RequestError, match=why):
        _decode(r, mode, room=2)


@pytest.mark.parametrize("scale", [1.0009, 0.9991])
@pytest.mark.parametrize("mode", [pb.PROPOSAL_MODE_DENSE, pb.PROPOSAL_MODE_SPARSE])
def test_a_q_within_the_tolerance_is_used_as_the_distribution_it_was_drawn_from(scale, mode):
    """A q row may sum to 1 within the wire's tolerance; a token drawn from it was drawn from q
    divided by its sum (sampling.sample_with divides by the total), so that is the q the rule
    gets, which is exact for it (tests/test_acceptance.py). Used as sent, the output's
    distribution was off: a total variation of 3e-4 at a sum of 1.0009, by exact enumeration."""
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2, 0.0, 0.0])
    for x in range(5):
        if mode == pb.PROPOSAL_MODE_DENSE:
            r = pb.Round(round=1, tokens=[x], q_probs=(q * scale).tolist())
        else:
            r = pb.Round(round=1, tokens=[x], q_counts=[5], q_ids=list(range(5)), q_probs=(q[:5] * scale).tolist())
        _, got = _decode(r, mode)
        torch.testing.assert_close(got[0], q, atol=1e-7, rtol=0)


@pytest.mark.parametrize("mode", [pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_DENSE, pb.PROPOSAL_MODE_GREEDY])
def test_a_draft_whose_logits_are_not_finite_raises_the_same_error_chain_or_tree(mode):
    """From a review: NaN draft logits raised "no mass to draw from" only for a dense chain; a
    sparse chain failed in an unrelated error, a dense tree in an IndexError, and a sparse or
    greedy tree went out as an empty round, hiding the broken draft."""
    import types

    from draft_service.tree import _children, _Tree
    from specdec.proposal import wire_q
    from specdec.sampling import Sampling

    logits = torch.full((8,), float("nan"))
    greedy = mode == pb.PROPOSAL_MODE_GREEDY
    prm = types.SimpleNamespace(mode=mode, sampling=Sampling(temperature=0.0 if greedy else 0.8), sparse_k=4, seed=3)
    says = "no mass to draw from"
    if not greedy:
        with pytest.raises(ValueError, match=says):
            wire_q(torch.softmax(logits, -1), mode, 4)
    with pytest.raises(ValueError, match=says):
        _children(_Tree(at=-1, logits=logits, nodes=[], kids=[]), -1, logits, prm, base=5, k=3, floor=0.0)
    fine = _Tree(at=-1, logits=torch.arange(8.0), nodes=[], kids=[])
    _children(fine, -1, fine.logits, prm, base=5, k=3, floor=0.0)
    assert 1 <= len(fine.nodes) <= 3  # finite logits: children as before

    # a chain from the draft model: in greedy or ids-only mode it proposed the NaN's index, round after round
    from draft_service.drafter import Drafter
    from specdec.validation import GenParams

    class Broken(Drafter):
        def __init__(self, logits):
            self.logits = logits

        def _feed(self, st, context):
            return self.logits

    st = types.SimpleNamespace(ids=[1, 2], params=GenParams([1, 2], 5, prm.sampling, 3, mode=mode))
    for bad in (logits, torch.full((8,), float("-inf"))):
        with pytest.raises(ValueError, match=says):
            Broken(bad).propose(st, 3)
    assert len(Broken(torch.arange(8.0)).propose(st, 3).tokens) == 3


def test_a_rounds_q_stays_its_entries_until_the_pass_scatters_it_on_the_device():
    """From issue 25's list: a sampled round's q was a dense [tau, V] table on the host, and a pass
    stacked every session's into a [B, T, V] host table before one copy (5.8 ms a round and 191 ms
    a pass of 64 sessions at V = 128k). The round keeps the entries the wire carried (K a row in
    sparse mode, one in ids-only), `cut` keeps the first rows', and the pass's `jobs._q` scatters all
    sessions' into the table on the device: the same table the dense stacking made."""
    from types import SimpleNamespace

    from verify_service.jobs import _q as pass_table

    rounds, tables = [], []
    for i, mode in enumerate((pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_GREEDY, pb.PROPOSAL_MODE_DENSE, pb.PROPOSAL_MODE_SPARSE)):
        prop = Proposal()
        for j in range(3 - i % 2):
            ids, vals = sparsify(_q(10 * i + j), 3)
            prop.add(int(ids[0]), mode, *((vals, ids) if mode == pb.PROPOSAL_MODE_SPARSE else (_q(10 * i + j),) if mode == pb.PROPOSAL_MODE_DENSE else ()))
        tokens, q = decode_round(prop.to_round(1), expected=1, room=100, vocab_size=V, mode=mode, greedy=False)
        assert q.tau == len(tokens) and q.probs.numel() == {pb.PROPOSAL_MODE_SPARSE: 3, pb.PROPOSAL_MODE_GREEDY: 1}.get(mode, V) * q.tau
        rounds.append(q)
        tables.append(q.dense(V))
    assert torch.equal(rounds[0].cut(1).dense(V), tables[0][:1]) and rounds[0].cut(5).tau == 3
    greedy, sampled = SimpleNamespace(sampling=SimpleNamespace(greedy=True)), SimpleNamespace(sampling=SimpleNamespace(greedy=False))
    jobs = [SimpleNamespace(q=q, session=sampled) for q in rounds] + [SimpleNamespace(q=None, session=sampled),
                                                                       SimpleNamespace(q=rounds[0], session=greedy)]
    table = pass_table(jobs, torch.zeros(len(jobs), 5, V), 4)
    want = torch.zeros(len(jobs), 4, V)
    for b, t in enumerate(tables):
        want[b, : t.shape[0]] = t
    assert torch.equal(table, want)  # no q for a target-only step, nor for a greedy session's round
