"""Uniform passes of rounds (specdec/engine/graphs.py): on the CPU eagerly, on CUDA as CUDA graphs."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.acceptance import accept_batch, accept_tree, tree_tables
from specdec.engine import Engine, KVCache, Plan
from specdec.engine.attention import ATTN, set_opaque
from specdec.engine.compiled import compile_layers, decoder_layers
from specdec.engine.graphs import pages_bucket, uniform_pass
from specdec.lm import LM

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def engine_on(model_dir, device: str, graphs: bool | None) -> tuple[Engine, torch.nn.Module]:
    """The tiny target's engine in float32 on `device` with uniform passes (graphs where asked), and the model itself."""
    lm = LM.load(model_dir("target"), device, "float32", prepare_engine=False, check=False)
    reference = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=torch.float32).eval().to(device)
    lm.model.set_attn_implementation(ATTN)
    return Engine(lm.model, Plan(kv_dtype=torch.float32, graphs=bool(graphs)), uniform=True), reference


def sessions(seed: int, k: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, 16) for _ in range(r.randint(20, 90))] for _ in range(k)]


def rounds_of(eng: Engine, seqs: list[list[int]], sizes: list[list[int]]) -> list[torch.Tensor]:
    """Prefills each sequence but its rounds, then runs every session's rounds (sizes[i]: its
    rounds' lengths) together, pass by pass; returns each pass's padded logits."""
    caches = [KVCache(len(s)) for s in seqs]
    at = [len(s) - sum(z) for s, z in zip(seqs, sizes)]
    eng.forward([s[:a] for s, a in zip(seqs, at)], caches, logits=False)
    outs = []
    for r in range(len(sizes[0])):
        ins = [s[a : a + z[r]] for s, a, z in zip(seqs, at, sizes)]
        outs.append(eng.forward(ins, caches, padded=True).clone())  # a graph's output buffer is the next pass's too
        at = [a + z[r] for a, z in zip(at, sizes)]
    for c in caches:
        c.release()
    return outs


def check_against_model(reference, seqs, sizes, outs) -> None:
    """Each pass's logits are the model's own at those positions; padding rows repeat their input's last."""
    for k, s in enumerate(seqs):
        with torch.no_grad():
            want = reference(torch.tensor([s], device=outs[0].device)).logits[0].float()
        at = len(s) - sum(sizes[k])
        for r, out in enumerate(outs):
            n = sizes[k][r]
            torch.testing.assert_close(out[k, :n], want[at : at + n], atol=2e-5, rtol=1e-4)
            assert torch.equal(out[k, n:], out[k, n - 1 : n].expand(out.shape[1] - n, -1))
            at += n


def test_uniform_passes_of_rounds_serve_the_models_own_logits(model_dir):
    """Rounds of different lengths, 5 sessions in a bucket of 8, keys read through a power-of-two
    page table: the model's own logits, every padding row its input's last."""
    torch.set_num_threads(1)
    eng, reference = engine_on(model_dir, "cpu", graphs=False)
    seqs = sessions(2, 5)
    sizes = [[random.Random(i).randint(1, 5) for _ in range(3)] for i in range(5)]
    outs = rounds_of(eng, seqs, sizes)
    assert len(eng.uniform.shapes) >= 1 and all(B == 8 for B, _, _ in eng.uniform.shapes)
    check_against_model(reference, seqs, sizes, outs)


def test_passes_that_do_not_fit_a_uniform_shape_take_the_packed_pass(model_dir):
    eng, _ = engine_on(model_dir, "cpu", graphs=False)
    assert eng.uniform.shape([5] * 64) == (64, 5)
    assert eng.uniform.shape([5] * 65) is None  # more inputs than the largest bucket
    assert eng.uniform.shape([17, 1]) is None  # a round longer than MAX_ROWS
    assert [pages_bucket(p) for p in (1, 4, 5, 9, 33)] == [4, 4, 8, 16, 64]
    c = KVCache(40)
    eng.forward([[1, 2, 3]], [c], logits=False)  # a prefill: never uniform
    eng.forward([[4, 5]], [c], logits=[True], padded=False)  # logits per input: the packed pass
    assert eng.uniform.shapes == {}


def test_the_uniform_pass_compiles_whole_without_graph_breaks(model_dir):
    """torch.compile(fullgraph=True) traces a uniform pass (layout, model, head) in one graph, and
    the compiled pass gives the eager one's logits and writes the same keys and values."""
    torch.set_num_threads(1)
    eng, _ = engine_on(model_dir, "cpu", graphs=False)
    seqs = sessions(6, 3)
    caches = [KVCache(len(s)) for s in seqs]
    eng.forward([s[:12] for s in seqs], caches, logits=False)
    n, P = 4, 4
    head = torch.tensor([[n, 12, *s[12:16]] for s in seqs] + [[1, 0, *[0] * n]])  # three sessions' rounds and a padding input
    table = torch.tensor([[*c.pages[:P], *[0] * (P - len(c.pages[:P]))] for c in caches] + [[0] * P])  # a bucket of 4
    with torch.inference_mode():
        before = [t.clone() for t in eng.pool.k + eng.pool.v]  # the pool without the round's keys and values
        eager = uniform_pass(eng, head, table)
        written = [t.clone() for t in eng.pool.k + eng.pool.v]
        explained = torch._dynamo.explain(uniform_pass)(eng, head, table)
        assert explained.graph_break_count == 0, explained.break_reasons
        for t, b in zip(eng.pool.k + eng.pool.v, before):  # the round's slots as they were: the compiled pass must write them
            t.copy_(b)
        compiled = torch.compile(uniform_pass, fullgraph=True)(eng, head, table)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(written, before))  # the eager pass wrote the round's keys and values
    for a, b in zip(written, eng.pool.k + eng.pool.v):  # and so did the compiled one, in place (inductor's fused kernels
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)  # round their own way)


@CUDA
def test_cuda_graph_replays_give_the_eager_passes_logits(model_dir):
    eng, reference = engine_on(model_dir, "cuda", graphs=True)
    seqs = sessions(3, 6)
    sizes = [[5, 5, 3, 5, 1, 5] for _ in range(6)]
    outs = rounds_of(eng, seqs, sizes)
    assert eng.uniform.captures >= 1 and eng.uniform.capture_s > 0
    check_against_model(reference, seqs, sizes, outs)
    again = rounds_of(eng, seqs, sizes)  # every shape captured now: replays only
    for a, b in zip(outs, again):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@CUDA
def test_compiled_cuda_graph_replays_give_the_models_logits(model_dir):
    torch._dynamo.reset()
    eng, reference = engine_on(model_dir, "cuda", graphs=True)
    try:
        assert compile_layers(eng) == list(decoder_layers(eng.model))  # every layer whole
        seqs = sessions(5, 6)
        sizes = [[5, 5, 3, 5, 1, 5] for _ in range(6)]
        outs = rounds_of(eng, seqs, sizes)
        assert eng.uniform.captures >= 1 and eng.uniform.graphs
        check_against_model(reference, seqs, sizes, outs)
    finally:
        set_opaque(False)


def verdicts(lg: torch.Tensor, ins: list[list[int]], at: int, rule: str, q: torch.Tensor) -> torch.Tensor:
    """The batched acceptance of a pass's logits [B, 5, V] for rounds of 4 proposals (ins[b][1:]),
    by `rule`: greedy, sampled (temperature 0.8, the draft's q given) or as trees of 4 nodes (the
    same rows read as a tree's: nodes 0 and 1 children of the pending token, 2 of 0, 3 of 1),
    sampled. Every per-session setting is a host tensor, as the scheduler makes them; returns the
    verdicts on the device (their copy to the host is the caller's)."""
    B, dev = lg.shape[0], lg.device
    proposals = torch.tensor([x[1:] for x in ins]).to(dev, non_blocking=True)
    greedy = torch.full((B,), rule == "greedy")
    settings = (greedy, torch.arange(B, dtype=torch.long) + 7, torch.full((B,), at), torch.full((B,), 0.8, dtype=torch.float64),
                torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.float64))
    if rule == "tree":
        return accept_tree(lg, proposals, torch.full((B,), 4), tree_tables([[-1, -1, 0, 1]] * B, 5), q, *settings)
    return torch.stack(accept_batch(lg, proposals, torch.full((B,), 4), q, *settings), 1)


@CUDA
@pytest.mark.parametrize("rule", ["greedy", "sampled", "tree"])
def test_a_graphed_pass_and_its_acceptance_never_sync_the_host(model_dir, rule):
    """After a shape's warm-up pass and its capture, a pass of rounds and the batched acceptance on
    its logits (greedy, sampled with the draft's q, or the tree rule) run under
    torch.cuda.set_sync_debug_mode("error"): the verdicts' one copy to the host (the scheduler's
    .tolist()) is the pass's only sync."""
    eng, _ = engine_on(model_dir, "cuda", graphs=True)
    seqs = sessions(4, 3)
    caches = [KVCache(len(s)) for s in seqs]
    eng.forward([s[:10] for s in seqs], caches, logits=False)
    B, V = len(seqs), eng.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(B, 4, V) if rule == "greedy" else torch.softmax(torch.randn(B, 4, V, generator=g), -1)
    q = q.to("cuda")
    for at in (10, 15, 20):  # eager, capture, replay
        ins = [s[at : at + 5] for s in seqs]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = verdicts(eng.forward(ins, caches, padded=True), ins, at, rule, q)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.tolist()  # the one sync
        for c in caches:
            c.crop(at + 5)
    assert eng.uniform.captures == 1


@CUDA
def test_a_grown_pool_drops_its_graphs_and_passes_stay_right(model_dir):
    eng, reference = engine_on(model_dir, "cuda", graphs=True)
    seqs = sessions(5, 2)
    sizes = [[5] * 4, [5] * 4]
    check_against_model(reference, seqs, sizes, rounds_of(eng, seqs, sizes))
    captured = eng.uniform.captures
    slots = eng.pool.k[0].shape[0]
    hogs = [eng.cache(4 * slots) for _ in range(2)]  # pages past the pool's end: the next pass grows it
    outs = rounds_of(eng, seqs, sizes)
    assert eng.pool.k[0].shape[0] > slots and eng.uniform.captures > captured
    check_against_model(reference, seqs, sizes, outs)
    for h in hogs:
        h.release()


def first_round_on_fresh_pages(eng: Engine, reference) -> None:
    """A session whose first pass is a round (a one-token prompt: no prefill) on pages past the
    pool's tensors, beside sessions whose shape has a graph: that pass must grow the pool."""
    seqs = sessions(11, 3)
    caches = [KVCache(len(s) + 8) for s in seqs]
    eng.forward([s[:-1] for s in seqs], caches, logits=False)
    for _ in range(3):  # the shape's first pass runs eagerly, the second captures, the third replays
        eng.forward([[s[-1]] for s in seqs], caches, padded=True)
        for c, s in zip(caches, seqs):
            c.crop(len(s) - 1)
    slots = eng.pool.k[0].shape[0]
    fresh = KVCache(2 * slots)
    eng.forward([[seqs[0][-1]], [seqs[1][-1]], [3]], [caches[0], caches[1], fresh], padded=True)  # it grows the pool
    assert eng.pool.k[0].shape[0] >= eng.pool.slots > slots
    out = eng.forward([[seqs[0][-1]], [seqs[1][-1]], [4]], [caches[0], caches[1], fresh], padded=True)[:, :1]
    with torch.no_grad():
        want = reference(torch.tensor([[3, 4]], device=out.device)).logits[0, -1].float()
    torch.testing.assert_close(out[2, 0], want, atol=2e-5, rtol=1e-4)
    for c in [*caches, fresh]:
        c.release()


def test_a_graph_is_not_replayed_while_the_pool_must_grow(model_dir, monkeypatch):
    """A replay runs no Python, so it cannot grow the pool: a pass whose sessions hold pages past
    the pool's tensors grows it first (`Pool.fit`) and drops the graphs, whose kernels hold the
    old tensors' addresses (it replayed, and read and wrote slots past the tensors' end: a
    device-side assert on CUDA). Here a replay is emulated on the CPU: the captured pass run on
    the pool's tensors as they were at its capture, as a graph's baked addresses are; a replay
    after a growth without the drop reads past their end and fails."""
    from specdec.engine import graphs

    eng, reference = engine_on(model_dir, "cpu", graphs=None)
    eng.uniform.graphs = True
    replays = []

    class Replay:
        def __init__(self, sh):
            self.sh, self.tensors = sh, (list(eng.pool.k), list(eng.pool.v))  # the addresses a capture bakes in

        def replay(self):
            replays.append(eng.pool.slots)
            now = eng.pool.k, eng.pool.v
            eng.pool.k, eng.pool.v = self.tensors
            try:
                self.sh.out = uniform_pass(eng, self.sh.head, self.sh.table)
            finally:
                eng.pool.k, eng.pool.v = now

    def capture(self, sh):
        sh.graph = Replay(sh)
        self.captures += 1

    monkeypatch.setattr(graphs.Uniform, "_capture", capture)
    first_round_on_fresh_pages(eng, reference)
    assert eng.uniform.captures >= 1 and replays


@CUDA
def test_a_round_on_fresh_pages_grows_the_pool_before_any_replay(model_dir):
    eng, reference = engine_on(model_dir, "cuda", graphs=True)
    first_round_on_fresh_pages(eng, reference)
    assert eng.uniform.captures >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="makes a capture fail by asking for one without CUDA")
def test_a_failed_capture_leaves_the_passes_eager_and_right(model_dir, caplog):
    """A shape's second pass tries a capture; where it fails (here: no CUDA at all) the engine logs
    it once, turns graphs off and serves every pass eagerly, the failed one included."""
    eng, reference = engine_on(model_dir, "cpu", graphs=True)
    seqs = sessions(7, 2)
    sizes = [[5, 5, 5], [5, 5, 5]]
    check_against_model(reference, seqs, sizes, rounds_of(eng, seqs, sizes))
    assert not eng.uniform.graphs and eng.uniform.captures == 0
    assert caplog.text.count("CUDA graph capture failed") == 1


def test_the_cpu_keeps_the_packed_pass_and_refuses_graphs(model_dir, caplog):
    lm = LM.load(model_dir("target"), "cpu", "float32", check=False, graphs=True, compiled=True)
    assert lm.engine.uniform is None and not lm.engine.plan.graphs and lm.engine.plan.per_query
    assert not lm.engine.plan.compiled and lm.engine.compiled == []
    assert "CUDA graphs need a CUDA device" in caplog.text and "compiled layers are for a GPU" in caplog.text
