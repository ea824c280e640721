"""Tree speculation (DESIGN.md §12): the engine's tree pass, the multi-candidate rule, the accepted
path's KV, the tree drafter, and seeded reproducibility through the real services.

The sampled distribution through the services is tested in test_lossless.py (tree configs, 16
requests in flight); greedy exactness for every architecture in test_architectures.py."""
import asyncio
import collections

import pytest
import torch
from scipy import stats

from client import AsyncClient, Client
from draft_service.drafter import Drafter, DraftState
from helpers import archmodels
from specdec.acceptance import accept_tree, tree_tables
from specdec.engine import Engine, KVCache, Plan, Tree
from specdec.lm import LM
from specdec.sampling import Sampling
from specdec.validation import GenParams
from specdec.v1 import specdec_pb2 as pb

# a chain of 12 nodes with side branches: past the arch models' window (8) inside the tree too
PARENTS = (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 12, 3, 14, 14, 9)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt2", "qwen2"])
@pytest.mark.parametrize("layout", ["cpu", "cpu-mask", "gpu"])
def test_each_tree_node_gets_its_branch_logits_and_the_path_its_keys(tmp_path, name, layout):
    """One pass over two trees, beside other sessions' rounds, gives every node the logits a chain
    pass over its branch gives; after the accepted path's keys and values are moved into place, the
    cache holds what a chain pass over the path writes. Bitwise in the CPU's layout (each path of
    each tree an input with its branch's keys), to float rounding with a tree mask over the nodes
    (the draft's choice on the CPU, and the GPU's layout, run here on the CPU)."""
    lm = LM.load(archmodels.build(str(tmp_path), name, seed=0), "cpu", "float32")
    eng = lm.engine if layout != "gpu" else Engine(lm.model, Plan(kv_dtype=torch.float32))
    same = torch.equal if layout == "cpu" else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-4))
    paths = layout == "cpu"
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, archmodels.V, (20,), generator=g).tolist()
    tokens = torch.randint(2, archmodels.V, (len(PARENTS),), generator=g).tolist()
    tree = Tree(len(prompt), PARENTS)
    prompt2 = torch.randint(2, archmodels.V, (37,), generator=g).tolist()  # a second tree: other pages, another shape
    parents2 = (-1, 0, 0, 1, 2, 2, 5)
    tokens2 = torch.randint(2, archmodels.V, (len(parents2),), generator=g).tolist()
    tree2 = Tree(len(prompt2), parents2)

    def prefilled(ids=prompt):
        kv = KVCache(len(ids) + len(PARENTS) + 1)
        eng.forward([ids], [kv], logits=False)
        return kv

    kv, others = prefilled(), [prefilled(prompt[:7]), prefilled(prompt[3:])]
    kv2 = prefilled(prompt2)
    got, _, got2, _ = eng.forward([tokens, [5, 6, 7], tokens2, [8]], [kv, others[0], kv2, others[1]],
                                  trees=[tree, None, tree2, None], tree_paths=paths)
    assert kv.length == len(prompt) + len(PARENTS) and kv2.length == len(prompt2) + len(parents2)
    for t, toks, base, out in ((tree, tokens, prompt, got), (tree2, tokens2, prompt2, got2)):
        for m in range(len(t)):
            branch = [toks[a] for a in t.ancestors(m)]
            (want,) = eng.forward([branch], [prefilled(base)])
            assert same(out[m], want[-1]), (name, layout, m, t.depth[m], (out[m] - want[-1]).abs().max())
    path = tree.ancestors(17)  # 0 1 2 ... 9 17: a path that leaves the chain at its end
    src, dst = kv.path_slots(len(prompt) - 1, [r + 1 for r in path])
    eng.pool.move(src, dst)
    kv.crop(len(prompt) + len(path))
    chain = prefilled()
    eng.forward([[tokens[a] for a in path]], [chain])  # with logits: a round, not a prompt chunk (with per-row products, a
    # keys-only input of more than PER_ROW_LEAD tokens is a GEMM of its own, whose numbers are its own)
    for i in range(kv.layers):
        for a, b in zip(kv.layer(i), chain.layer(i)):
            assert same(a, b), (name, layout, i)


def test_a_chain_as_a_tree_gives_the_chain_pass():
    t = Tree.chain(5, 4)
    assert t.parents == (-1, 0, 1, 2) and t.depth == (0, 1, 2, 3) and t.ancestors(3) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="parent"):
        Tree(0, (-1, 1))


# ---- the multi-candidate rule --------------------------------------------------------------------

V = 5
TREE = [-1, -1, -1, 0, 0, 1]  # three children of the pending token; two under the first, one under the second


def _sibling_draws(q: torch.Tensor, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from each row of q [B, V] (Gumbel top-k: the same law as one draw
    after another from what the earlier ones left), and each draw's q [B, k, V]: q with the earlier
    draws removed, renormalized."""
    gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g, dtype=torch.float64)))
    x = torch.topk(q.double().log() + gumbel, k, dim=1).indices  # [B, k]
    qs, left = [], q.double().clone()
    for i in range(k):
        qs.append(left / left.sum(1, keepdim=True))
        left = left.scatter(1, x[:, i : i + 1], 0.0)
    return x, torch.stack(qs, 1).float()


def _rounds(B: int, one_hot: bool, seed: int):
    """B tree rounds on a 5-token vocabulary whose target depends on the branch: p0 at the pending
    token, p1[a] after a, p2[a, b] after a, b. Sparse trees draw siblings without replacement from the
    draft's q; ids-only trees take the draft's top tokens with one-hot q."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    p1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, 1)
    p2 = torch.softmax(torch.randn(V, V, V, generator=g) * 1.5, 2)
    q0 = torch.softmax(torch.randn(V, generator=g), 0)
    q1 = torch.softmax(torch.randn(V, V, generator=g), 1)
    if one_hot:
        xs = torch.topk(q0, 3).indices.expand(B, 3)
        ys, zs = torch.topk(q1[xs[:, 0]], 2, dim=1).indices, torch.topk(q1[xs[:, 1]], 1, dim=1).indices
        tokens = torch.cat([xs, ys, zs], 1)
        q = torch.nn.functional.one_hot(tokens, V).float()
    else:
        xs, qx = _sibling_draws(q0.expand(B, V), 3, g)
        ys, qy = _sibling_draws(q1[xs[:, 0]], 2, g)
        zs, qz = _sibling_draws(q1[xs[:, 1]], 1, g)
        tokens, q = torch.cat([xs, ys, zs], 1), torch.cat([qx, qy, qz], 1)
    logits = torch.stack([p0.expand(B, V), p1[xs[:, 0]], p1[xs[:, 1]], p1[xs[:, 2]], p2[xs[:, 0], ys[:, 0]], p2[xs[:, 0], ys[:, 1]],
                          p2[xs[:, 1], zs[:, 0]]], 1).log()
    return tokens, q, logits, p0, p1


def _accept(tokens, q, logits, greedy=False, temperature=1.0, seed0=0):
    B = tokens.shape[0]
    return accept_tree(logits, tokens, torch.full((B,), len(TREE)), tree_tables([TREE] * B, len(TREE) + 1), q,
                       torch.full((B,), greedy), torch.arange(seed0, seed0 + B), torch.full((B,), 100),
                       torch.full((B,), temperature, dtype=torch.float64), torch.zeros(B, dtype=torch.long),
                       torch.ones(B, dtype=torch.float64))


@pytest.mark.parametrize("one_hot", [False, True], ids=["sparse", "ids-only"])
def test_the_tree_rule_emits_the_target_distribution(one_hot):
    """Each round's first token has the target's p0, and given the path reached node a, the token
    after it has p1[a]: chi-square, 20,000 seeded rounds."""
    B = 20_000
    tokens, q, logits, p0, p1 = _rounds(B, one_hot, seed=1)
    out = _accept(tokens, q, logits)
    n, nxt, on = out[:, 0], out[:, 1], out[:, 2:].bool()
    first = torch.where(n > 0, _first_on_path(tokens, on), nxt)
    counts = torch.bincount(first, minlength=V).double()
    assert stats.chisquare(counts, p0.double() / p0.double().sum() * B).pvalue > 1e-3, (counts / B, p0)
    assert (n >= 1).float().mean() > 0.3 and (n >= 2).any(), "paths must go through the tree for this to test anything"
    second = torch.where(n >= 2, _second_on_path(tokens, on), nxt)
    tested = 0
    for a in range(V):
        sel = (n >= 1) & (first == a)
        if sel.sum() < 2000:
            continue
        c = torch.bincount(second[sel], minlength=V).double()
        expect = p1[a].double() * sel.sum()
        keep = expect >= 5
        c_rest, e_rest = c[~keep].sum(), expect[~keep].sum()
        obs = torch.cat([c[keep], c_rest[None]]) if e_rest > 0 else c[keep]
        exp = torch.cat([expect[keep], e_rest[None]]) if e_rest > 0 else expect[keep]
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3, (a, c / sel.sum(), p1[a])
        tested += 1
    assert tested >= 1


def _first_on_path(tokens, on):
    idx = torch.where(on, torch.arange(on.shape[1]), on.shape[1]).min(1).values.clamp(max=on.shape[1] - 1)
    return tokens.gather(1, idx[:, None]).squeeze(1)


def _second_on_path(tokens, on):
    order = torch.where(on, torch.arange(on.shape[1]), on.shape[1]).sort(1).values[:, 1].clamp(max=on.shape[1] - 1)
    return tokens.gather(1, order[:, None]).squeeze(1)


def test_greedy_tree_rule_takes_the_longest_branch_of_argmaxes():
    tokens, q, logits, _, _ = _rounds(64, one_hot=False, seed=2)
    out = _accept(tokens, q, logits, greedy=True)
    tables = tree_tables([TREE], len(TREE) + 1)
    for b in range(64):
        am = logits[b].argmax(-1).tolist()
        node, path = -1, []  # walk: the child whose token is the argmax at its parent
        while True:
            kids = [i for i, p in enumerate(TREE) if p == node and tokens[b, i] == am[node + 1]]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        got = [i for i in range(len(TREE)) if out[b, 2 + i]]
        assert got == path and out[b, 0] == len(path) and out[b, 1] == am[node + 1], (b, got, path)
    assert tables["kids"].shape == (1, 7, 3)


def test_a_chain_tree_draws_what_the_chain_rule_draws():
    """A tree that is a chain uses the chain's uniforms: the same verdicts as accept_batch."""
    from specdec.acceptance import accept_batch
    g = torch.Generator().manual_seed(3)
    B, T = 256, 4
    logits = torch.randn(B, T + 1, V, generator=g) * 2
    q = torch.softmax(torch.randn(B, T, V, generator=g), -1)
    tokens = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, T)
    args = (torch.zeros(B, dtype=torch.bool), torch.arange(B), torch.full((B,), 7), torch.ones(B, dtype=torch.float64),
            torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.float64))
    n, nxt = accept_batch(logits, tokens, torch.full((B,), T), q, *args)
    out = accept_tree(logits, tokens, torch.full((B,), T), tree_tables([[-1, 0, 1, 2]] * B, T + 1), q, *args)
    assert torch.equal(out[:, 0], n) and torch.equal(out[:, 1], nxt)


# ---- the drafter -------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,mode", [(0.0, pb.PROPOSAL_MODE_GREEDY), (1.0, pb.PROPOSAL_MODE_SPARSE),
                                              (1.0, pb.PROPOSAL_MODE_GREEDY)])
def test_the_drafter_grows_a_tree_within_budget_and_depth(model_dir, temperature, mode):
    lm = LM.load(model_dir("draft"), "cpu", "float32")
    d = Drafter(lm)
    g = GenParams(prompt_ids=[3, 4, 5, 6], max_new_tokens=40, sampling=Sampling(temperature), seed=11, tau=5, mode=mode,
                  tree_budget=12)
    st = d.new_state(g, lm.max_context)
    d.prefill(st)
    prop = d.propose_tree(st, 12, 5)
    parents, depth = prop.parents, []
    for i, p in enumerate(parents):
        assert -1 <= p < i
        depth.append(0 if p < 0 else depth[p] + 1)
    assert 2 <= len(prop.tokens) <= 12 and max(depth) < 5 and max(depth) >= 1, (prop.tokens, parents)
    for p in set(parents):  # siblings are distinct tokens
        kids = [prop.tokens[i] for i in range(len(parents)) if parents[i] == p]
        assert len(kids) == len(set(kids))
    assert prop.guess and parents[prop.guess[0]] == -1 and all(parents[b] == a for a, b in zip(prop.guess, prop.guess[1:]))
    assert st.cache.length == len(st.ids) and st.cached == st.ids, "the tree's nodes are cropped off the draft's cache"
    again = d.propose_tree(st, 12, 5)
    assert (again.tokens, again.parents, again.q_probs) == (prop.tokens, prop.parents, prop.q_probs), "a round's tree is its context's"
    if mode == pb.PROPOSAL_MODE_SPARSE:
        assert len(prop.q_counts) == len(prop.tokens) and all(c > 0 for c in prop.q_counts)
    tight = DraftState(ids=list(st.ids), params=g, cache=KVCache(len(st.ids) + 3))  # near the context limit: room for 3 nodes
    d.prefill(tight)
    assert 1 <= len(d.propose_tree(tight, 12, 5).tokens) <= 12 and tight.cache.length == len(st.ids)


@pytest.mark.parametrize("sharp,deepest", [(30.0, 5), (0.0, 2)])
def test_a_sampled_tree_of_a_sure_draft_grows_deep_and_of_an_unsure_one_wide(model_dir, sharp, deepest):
    """From a review: every expanded node of a sampled tree drew 4 children whatever their
    probability, so a budget of 16 stopped every tree at depth 2 (4 + 12 nodes) and sampled trees
    committed fewer tokens a round than an 8-token chain (2.58 against 2.67 on the shipped pair).
    A node gets no more children than its q has tokens of probability SAMPLED_MIN_Q or more (one at
    least): a draft sure of its tokens (logits sharpened here) grows the tree deep; a flat one over
    this test model's 16 tokens (each 1/16, above the bar) still spends the budget on width. (A q
    flat over many tokens, none of them that likely, gets one child a node: a chain.)"""
    from draft_service.tree import BRANCH

    lm = LM.load(model_dir("draft"), "cpu", "float32")

    class Shaped(Drafter):  # the model's logits sharpened (sharp > 0: q near one-hot), or flattened (0)
        def _shape(self, logits):
            return logits * sharp if sharp else torch.zeros_like(logits)

        def _feed(self, st, context):
            return self._shape(super()._feed(st, context))

        def step_tree(self, cache, tokens, tree):
            return self._shape(super().step_tree(cache, tokens, tree))

    d = Shaped(lm)
    g = GenParams(prompt_ids=[3, 4, 5, 6], max_new_tokens=40, sampling=Sampling(1.0), seed=11, tau=8, mode=pb.PROPOSAL_MODE_SPARSE,
                  tree_budget=16)
    st = d.new_state(g, lm.max_context)
    d.prefill(st)
    prop = d.propose_tree(st, 16, 8)
    depth = []
    for p in prop.parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    assert max(depth) + 1 >= deepest, (prop.parents, depth)
    if not sharp:  # flat: each expanded node takes BRANCH children while the budget lasts
        assert prop.parents.count(-1) == BRANCH and max(depth) + 1 == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [pb.PROPOSAL_MODE_SPARSE, pb.PROPOSAL_MODE_DENSE])
def test_a_draft_on_cuda_grows_sampled_trees(model_dir, mode):
    """From a review: a sampled tree's draw took a CPU uniform of shape [1] beside the CUDA
    probabilities, which torch refuses, so every sampled tree request to a draft on a GPU ended
    INTERNAL at its first round."""
    lm = LM.load(model_dir("draft"), "cuda", "float32")
    d = Drafter(lm)
    g = GenParams(prompt_ids=[3, 4, 5, 6], max_new_tokens=40, sampling=Sampling(1.0), seed=11, tau=5, mode=mode, tree_budget=12)
    st = d.new_state(g, lm.max_context)
    d.prefill(st)
    prop = d.propose_tree(st, 12, 5)
    assert 2 <= len(prop.tokens) <= 12 and all(-1 <= p < i for i, p in enumerate(prop.parents))


# ---- through the services --------------------------------------------------------------------

def test_same_seed_same_tokens_with_trees_alone_and_under_load(services):
    """A seeded sampled tree request gives the same tokens alone and among 8 others in flight."""
    v, d = services("target", "draft")
    req = dict(prompt_ids=[3, 4, 5, 6], max_new_tokens=24, temperature=1.0, seed=1234, tree_budget=10, num_draft_tokens=4)
    with Client(d.address, timeout=120) as c:
        alone = c.generate(**req)
    assert alone.stats["tree_rounds"] > 0

    async def crowd():
        async with AsyncClient(d.address, timeout=120) as ac:
            others = [ac.generate(prompt_ids=[5, 6, 7], max_new_tokens=24, temperature=0.9, seed=i, tree_budget=6) for i in range(8)]
            return await asyncio.gather(ac.generate(**req), *others)

    loaded = asyncio.run(crowd())[0]
    assert loaded.token_ids == alone.token_ids
    assert loaded.seed == alone.seed == 1234


def test_tree_budget_past_the_verifiers_limit_is_refused_by_name(services):
    """The limit a client can read (the draft's Info reports its verify service's: it said 0, no
    trees, while it served them) is the one its requests meet."""
    v, d = services("target", "draft")
    with Client(v.address, target_only=True, timeout=60) as vc:
        assert vc.info().max_tree_budget == 64
    with Client(d.address, timeout=60) as c:
        c.generate(prompt_ids=[3, 4], max_new_tokens=4, tree_budget=64)  # the draft has met its verify service
        assert c.info().max_tree_budget == 64
        with pytest.raises(Exception, match="tree_budget.*64"):
            c.generate(prompt_ids=[3, 4], max_new_tokens=4, tree_budget=65)


def test_a_tree_session_keeps_its_trees_width_in_its_last_round(services):
    """SessionStart.tree_budget reserves room for a tree past the request's end: a round with
    more nodes than tokens left keeps them all (its accepted path may run through the last one),
    where a session without it has its round cut to the tokens left; a budget past the verify
    service's limit is refused by name."""
    import grpc

    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    v, _ = services("target", "draft")
    prompt = [3, 4, 5, 6]
    with Client(v.address, target_only=True, timeout=60) as vc:
        want = vc.generate(prompt_ids=prompt, max_new_tokens=2).token_ids  # the target's greedy pair
        fp = vc.info().vocab_fingerprint
    wrong = [t for t in range(2, 16) if t != want[0]][:4]
    tokens, parents = wrong + [want[0], want[1]], [-1] * 5 + [4]  # four wrong siblings, then the target's branch
    with grpc.insecure_channel(v.address) as ch:
        stub = pb_grpc.VerifyStub(ch)

        def first_verdict(**start):
            msgs = [pb.VerifyRequest(start=pb.SessionStart(prompt_ids=prompt, max_new_tokens=2, proposal_mode=pb.PROPOSAL_MODE_GREEDY,
                                                           vocab_fingerprint=fp, **start)),
                    pb.VerifyRequest(round=pb.Round(round=1, tokens=tokens, parents=parents))]
            return next(iter(stub.Session(iter(msgs), timeout=60)))

        wide = first_verdict(tree_budget=len(tokens))
        assert list(wide.accepted_path) == [4, 5] and wide.num_accepted == 2 and not wide.HasField("next_token")
        assert wide.finish_reason == pb.FINISH_REASON_LENGTH
        cut = first_verdict()  # no reservation: the round is cut to its first 2 nodes, both wrong
        assert list(cut.accepted_path) == [] and cut.num_accepted == 0 and cut.next_token == want[0]
        with pytest.raises(grpc.RpcError) as e:
            first_verdict(tree_budget=65)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_budget" in e.value.details() and "64" in e.value.details()


def test_greedy_trees_equal_target_only_on_the_tiny_pair(services):
    v, d = services("target", "draft")
    counts = collections.Counter()
    with Client(d.address, timeout=120) as dc, Client(v.address, target_only=True, timeout=120) as vc:
        for prompt in ([3, 4, 5], [7, 7, 8, 9, 2], [12, 3]):
            want = vc.generate(prompt_ids=prompt, max_new_tokens=30).token_ids
            for budget, tau in ((4, 2), (16, 6), (64, 16)):
                got = dc.generate(prompt_ids=prompt, max_new_tokens=30, tree_budget=budget, num_draft_tokens=tau, proposer="draft")
                assert got.token_ids == want, (prompt, budget, tau, got.stats)
                counts["tree_rounds"] += got.stats["tree_rounds"]
                counts["accepted"] += got.stats["accepted"]
    assert counts["tree_rounds"] > 0 and counts["accepted"] > 0


def test_a_tree_path_through_eos_ends_there(model_dir):
    """A tree whose accepted branch runs through EOS commits up to EOS, and its verdict's path stops
    there too (the draft commits the path's tokens: none past the end may come back)."""
    from transformers import AutoModelForCausalLM

    from helpers.greedy import hf_greedy, prompts
    from verify_service.scheduler import Scheduler

    path_dir = model_dir("target")
    model = AutoModelForCausalLM.from_pretrained(path_dir, dtype=torch.float32).eval()
    lm = LM.load(path_dir, "cpu", "float32")
    prompt, want = next((p, w) for p in prompts(64, seed=5) if 2 <= len(w := hf_greedy(model, p, 8)) < 8)  # ends at EOS (token 0)
    assert want[-1] in lm.eos
    sched = Scheduler(lm)
    try:
        async def run():
            s = sched.open(prompt, 20, Sampling(), 1, pb.PROPOSAL_MODE_GREEDY)
            await sched.prefill(s)
            with torch.no_grad():  # the target's own run, then its argmax past EOS (so the rule accepts it), and a side branch
                after = int(model(torch.tensor([prompt + want])).logits[0, -1].argmax())
            tokens = want + [after]
            parents = [-1] + list(range(len(tokens) - 1))
            v = await sched.step(s, tokens + [5], None, parents + [-1])
            return s, v

        s, v = asyncio.run(run())
    finally:
        sched.shutdown()
    assert s.ids[len(prompt):] == want and v.num_accepted == len(want) and v.path == list(range(len(want)))
    assert v.next_token is None and v.finish


def test_calibration_learns_from_the_nodes_whose_parent_was_reached():
    """Greedy trees score nodes by how often nodes like them were accepted: a node is tested when
    its parent is on the accepted path (or is the root), a hit when it is on the path itself."""
    from draft_service.tree import Calibration
    from specdec.proposal import Proposal

    cal = Calibration()
    assert cal(0, 0.25) == pytest.approx(0.25) and cal(2, 0.05) == pytest.approx(0.05)  # the prior: the draft's own probability
    prop = Proposal(tokens=[1, 2, 3, 4], parents=[-1, -1, 0, 2], ranks=[(0, 0.25), (1, 0.15), (0, 0.25), (0, 0.95)])
    for _ in range(40):  # node 0 accepted, node 1 (its sibling) not, node 2 accepted, node 3 tested and rejected
        cal.observe(prop, [0, 2])
    assert cal(0, 0.25) > 0.9 and cal(1, 0.15) < 0.05 and cal(0, 0.95) < 0.2
