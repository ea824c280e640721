"""The engine's pass: one pooled, paged KV cache, and a session's numbers bitwise its own alone or
batched, in a one-token step or inside a round, at the shipped widths, in both CPU dtypes."""
import random
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine import cached, load_packed, same_cache, steps_and_rounds
from specdec.engine import PAGE, KVCache
from specdec.engine.cpu.rows import clock
from specdec.lm import LM


@pytest.fixture(scope="module")
def loaded():
    """load_packed(path, dtype, matmuls), once per argument set in this module: each load
    calibrates the CPU tier (up to half a minute at these widths), and the tests only read the
    model (their caches give their pages back when dropped)."""
    held = {}

    def get(path: str, dtype: str, matmuls: str) -> LM:
        torch.set_num_threads(1)  # the services' setting, before the load's calibration
        if (path, dtype, matmuls) not in held:
            held[path, dtype, matmuls] = load_packed(path, dtype, matmuls)
        return held[path, dtype, matmuls]

    return get


@pytest.fixture(scope="module")
def real_width_dir(tmp_path_factory):
    """A random Llama of the shipped target's widths (hidden 512, MLP 1408, 8192 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tinymodels import word_tokenizer

    path = tmp_path_factory.mktemp("real-width")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    word_tokenizer(8192).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("viewed", [False, True], ids=["gathered", "viewed"])
def test_batched_pass_is_bitwise_equal_to_each_session_alone(packed, model_dir, monkeypatch, viewed):
    """Gathered: the tiny model's sessions read their keys through one gather per group. Viewed:
    every session whose pages are consecutive reads them as a view of the pool, in a group of its
    own (layout.VIEW_BYTES, what the CPU does where a session's keys are big)."""
    import specdec.engine.forward as fwd
    from specdec.engine import layout

    monkeypatch.setattr(layout, "VIEW_BYTES", 0 if viewed else layout.VIEW_BYTES)
    passes = []
    monkeypatch.setattr(fwd, "layout", lambda *a, **k: passes.append(layout.layout(*a, **k)) or passes[-1])
    reference = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=packed.dtype).eval()
    eng = packed.engine
    r = random.Random(0)
    seqs = [[r.randrange(1, 16) for _ in range(r.randint(2, 40))] for _ in range(7)]
    cut = [r.randint(0, len(s) - 1) for s in seqs]  # cached prefix lengths, 0 included

    batch = [cached(eng, s, c) for s, c in zip(seqs, cut)]
    news = [s[c:] for s, c in zip(seqs, cut)]
    logits = eng.forward(news, batch)
    views = sum(g.first_slot is not None for g in passes[-1].short)
    runs = sum(kv.pages[:-(-len(s) // 16)] == list(range(kv.pages[0], kv.pages[0] + -(-len(s) // 16))) for s, kv in zip(seqs, batch))
    if viewed:
        assert views == runs > 0, (views, runs)
    else:  # one group per size class (one alone in its class reads a view, as before)
        assert len(passes[-1].short) <= len(layout.GROUPS)
    for s, c, new, kv, lg in zip(seqs, cut, news, batch, logits):
        alone_kv = cached(eng, s, c)
        (alone,) = eng.forward([new], [alone_kv])
        assert torch.equal(alone, lg)  # bitwise: the batch does not change a session's numbers
        assert kv.length == len(s) and same_cache(alone_kv, kv, len(s))
        with torch.no_grad():
            full = reference(torch.tensor([s])).logits[0, c:].float()
        tol = dict(atol=1e-5, rtol=1e-4) if packed.dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
        torch.testing.assert_close(lg, full, **tol)


def test_caches_keep_their_pages_and_sessions_never_touch_each_other(packed):
    """A session's pages are taken once, at its first pass, and stay its own while others join,
    share passes, leave (giving their pages back), and while it is cropped and extended."""
    eng = packed.engine
    a = KVCache(30)
    eng.forward([[3, 4, 5, 6]], [a], logits=False)
    pages = list(a.pages)
    before = [t[:, :4].clone() for i in range(a.layers) for t in a.layer(i)]
    b, c = KVCache(20), KVCache(20)
    eng.forward([[7, 8], [9, 10, 11], [12]], [a, b, c])
    assert not set(a.pages) & set(b.pages) and not set(b.pages) & set(c.pages) and 0 not in a.pages + b.pages + c.pages
    freed = list(b.pages)
    b.release()
    d = KVCache(20)
    eng.forward([[4, 4]], [d])  # takes the pages b gave back
    assert set(d.pages) == set(freed)
    a.crop(5)  # a rejection: only the length moves
    eng.forward([[13, 14], [15]], [a, c])
    assert a.pages == pages and a.length == 7
    assert all(torch.equal(t[:, :4], x) for t, x in zip([t for i in range(a.layers) for t in a.layer(i)], before))  # earlier entries untouched
    with pytest.raises(ValueError, match="cache overflow"):
        eng.forward([[1] * 30], [a])
    assert a.length == 7  # a failed pass commits nothing


def test_a_growing_pool_keeps_what_its_sessions_hold(packed):
    """The pool grows (its tensors reallocated) when pages past their end are taken: the sessions
    already there keep bitwise their keys and values and their logits."""
    eng = packed.engine
    ids = [3 + i % 13 for i in range(40)]
    a, ref = KVCache(48), KVCache(48)
    eng.forward([ids], [a], logits=False)
    eng.forward([ids], [ref], logits=False)
    slots = eng.pool.k[0].shape[0]
    big = [KVCache(16 * 64) for _ in range(4)]  # more pages than the pool's tensors hold now
    eng.forward([[5]] * 4, big)
    assert eng.pool.k[0].shape[0] > slots
    assert same_cache(a, ref, 40)
    assert torch.equal(eng.forward([[7, 8]], [a])[0], eng.forward([[7, 8]], [ref])[0])


def test_a_growth_that_runs_out_of_memory_leaves_the_pool_whole(monkeypatch):
    """The growth replaced K, then V: where V's allocation failed (CUDA out of memory), K had grown
    and V had not, K's size then said no growth was needed, and every later pass that wrote past
    V's end failed with an IndexError, until a restart."""
    from specdec.engine import Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    like = torch.zeros(1, 2, 1, 4)
    pool.layer(0, like)
    before = [t.shape[0] for t in (pool.k[0], pool.v[0])]
    held = pool.cache(16 * 20)  # more pages than the tensors hold
    zeros, calls = torch.zeros, []

    def second_fails(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected: out of memory")
        return zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", second_fails)
    with pytest.raises(torch.OutOfMemoryError):
        pool.fit()
    assert [t.shape[0] for t in (pool.k[0], pool.v[0])] == before  # as it was
    monkeypatch.setattr(torch, "zeros", zeros)
    pool.fit()  # the next pass grows both
    k, v = pool.layer(0, like)
    assert k.shape == v.shape and k.shape[0] >= pool.slots
    assert held.pages


def test_a_growth_that_runs_out_of_memory_at_a_later_layer_leaves_every_layer_as_it_was(monkeypatch):
    """From a review: the layers grew one by one and `size` was set after the last, so memory that
    ran out at layer 1 left layer 0 grown (a new tensor) while `size`, which tells a CUDA graph
    its pool's tensors were replaced, said nothing had: the graphs replayed on freed memory."""
    from specdec.engine import PAGE, Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    like = torch.zeros(1, 2, 1, 4)
    pool.layer(0, like)
    pool.layer(1, like)
    tensors = [pool.k[0], pool.v[0], pool.k[1], pool.v[1]]
    held = pool.cache(40 * PAGE)
    zeros, calls = torch.zeros, []

    def third_fails(*a, **kw):  # layer 1's K
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected: out of memory")
        return zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", third_fails)
    size = pool.size
    with pytest.raises(torch.OutOfMemoryError):
        pool.fit()
    assert [t is u for t, u in zip([pool.k[0], pool.v[0], pool.k[1], pool.v[1]], tensors)] == [True] * 4 and pool.size == size
    monkeypatch.setattr(torch, "zeros", zeros)
    assert pool.fit() >= pool.slots and all(t.shape[0] == pool.size for t in pool.k + pool.v) and held.pages


def test_a_growth_refused_for_a_large_session_does_not_outlive_it(monkeypatch):
    """The pool sized itself to every page ever handed out: where memory refused the growth for
    a large session's pages, every later pass asked for the same growth after that session had
    ended, so a small session whose pages lay inside the pool failed too, and the verify service
    stayed NOT_SERVING until a restart. Free pages above every held one are forgotten now."""
    from specdec.engine import PAGE, Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    like = torch.zeros(1, 2, 1, 4)
    pool.layer(0, like)
    room = pool.fit()
    zeros = torch.zeros

    def no_memory_past(shape, *a, **kw):  # a device with no room for a larger pool
        if isinstance(shape, tuple) and shape[0] > room:
            raise torch.OutOfMemoryError("injected: out of memory")
        return zeros(shape, *a, **kw)

    monkeypatch.setattr(torch, "zeros", no_memory_past)
    small = pool.cache(2 * PAGE)
    assert pool.fit() == room
    big = pool.cache(40 * PAGE)
    with pytest.raises(torch.OutOfMemoryError):
        pool.fit()
    big.release()
    assert pool.held_slots() <= room < pool.slots  # the pages held fit; every page ever handed out would not
    assert pool.fit() == room  # the small session's passes run again
    again = pool.cache(2 * PAGE)
    assert pool.fit() == room and max(again.pages) * PAGE < room and small.pages


def test_the_pool_grows_at_a_passs_start_all_layers_alike_and_never_doubles_past_its_limit():
    """From a review: each layer grew when a pass first wrote it, to the pages handed out at that
    moment, doubling without a cap. Pages taken on the event loop in the middle of a pass (a
    session admitted) made later layers grow to other sizes than earlier ones (inside a CUDA
    graph's capture, too: its replays would then zero a layer), and a burst of admissions
    followed by one more made the pool twice the verify's cache budget: out of memory on a GPU
    whose budget was 90% of it. Now `fit` grows every layer once, at the pass's start, and the
    doubling stops at `limit` (a pass's own need still passes it, with a little room)."""
    from specdec.engine import PAGE, Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    pool.limit = 64 * PAGE + PAGE  # the verify's budget: 64 pages, and the trash page
    like = torch.zeros(1, 2, 1, 4)
    pool.fit()
    pool.layer(0, like)
    held = [pool.cache(16 * PAGE) for _ in range(3)]  # a burst of admissions: 49 pages handed out
    pool.fit()
    pool.layer(1, like)
    late = pool.cache(2 * PAGE)  # admitted during the pass: not in it
    sizes = [t.shape[0] for t in pool.k + pool.v]
    assert sizes == [49 * PAGE] * 4, sizes  # both layers as the pass's start left them
    held.append(pool.cache(13 * PAGE))  # 64 pages handed out
    assert pool.fit() == pool.limit  # 64 pages: the doubling stops at the limit (65 pages), not 98
    assert [t.shape[0] for t in pool.k + pool.v] == [pool.limit] * 4
    past = pool.cache(4 * PAGE)  # past the limit (a self-test's cache beside full sessions, say): the need wins, with some room
    assert pool.slots == 68 * PAGE and pool.fit() == 76 * PAGE  # 1 + 48 + 2 + 13 + 4 pages, and 8 more
    pool.cache(PAGE)
    assert pool.fit() == 76 * PAGE  # the next page fits without a copy of every layer
    assert late.pages and past.pages and held


def test_dropped_caches_give_their_pages_back():
    """A cache that is garbage-collected without release() returns its pages to the pool."""
    import gc

    from specdec.engine import Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    c = pool.cache(40)
    taken = set(c.pages)
    del c
    gc.collect()
    assert set(pool.cache(40).pages) == taken


def test_a_pass_hands_transformers_its_cache_under_the_current_name(packed):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns on
    every call and goes in 5.40): a pass, with logits or keys and values only, uses whichever name
    the installed version's forward takes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        packed.engine.forward([[3, 4, 5]], [KVCache(3)])  # the CausalLM's forward
        packed.engine.forward([[3, 4, 5]], [KVCache(3)], logits=False)  # the base model's


def test_cache_budget_is_sized_from_the_model_and_memory(packed):
    from specdec.engine import PAGE
    from verify_service.capacity import default_cache_budget, kv_bytes_per_token

    kv = KVCache(5)
    packed.engine.forward([[3, 4, 5, 6, 7]], [kv], logits=False)
    dt = packed.engine.plan.kv_dtype  # the model's, or float32 for a half-precision model where this CPU attends faster so
    assert dt in (packed.dtype, torch.float32)
    assert kv.layer(0)[0].dtype == dt and kv_bytes_per_token(packed.model.config, dt) == kv.nbytes() / (len(kv.pages) * PAGE)
    budget = default_cache_budget(packed, max_sessions=8)
    full = -(-packed.max_context // PAGE) * PAGE  # a whole-context session's reservation, in whole pages
    assert packed.max_context <= budget <= 8 * full


def test_a_default_budget_past_the_free_memory_is_logged(packed, monkeypatch, caplog):
    """Where the free memory's share holds less than one whole-context session, the default budget
    is still one such session (else no long request could be served), and the start-up says so:
    only a --max-cached-tokens above the memory share was logged, the default never."""
    import logging

    from verify_service import capacity

    per = capacity.kv_bytes_per_token(packed.model.config, packed.engine.plan.kv_dtype)
    monkeypatch.setattr(capacity, "available_memory_bytes", lambda device=None: 2 * 10 * per)  # 10 tokens at 50%
    with caplog.at_level(logging.WARNING, logger="specdec.verify"):
        assert capacity.default_cache_budget(packed, max_sessions=8) == packed.max_context
    assert any("holds 10 cache tokens, less than one session" in r.getMessage() for r in caplog.records), caplog.text
    monkeypatch.setattr(capacity, "available_memory_bytes", lambda device=None: 2 * 8 * packed.max_context * per)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.verify"):
        capacity.default_cache_budget(packed, max_sessions=8)
    assert not caplog.records


def test_default_budget_admits_every_session_at_full_context(packed, monkeypatch):
    """Admission counts whole pages, so the default budget must too: max_sessions sessions of the
    whole context fit (a bench of 32 sessions at a 684-token context was refused at the 32nd)."""
    from verify_service.capacity import Capacity, default_cache_budget

    monkeypatch.setattr(packed, "max_context", 684)  # not a whole number of pages
    budget = default_cache_budget(packed, max_sessions=8, memory_fraction=1.0)
    cap = Capacity(8, budget, PAGE)
    held = [cap.admit(packed.max_context) for _ in range(8)]
    assert cap.sessions == 8 and sum(held) == cap.reserved


MATMULS = [("float32", "calibrated"), ("bfloat16", "prepacked"), ("float32", "per-row"), ("float32", "row-kernel"),
           ("bfloat16", "unpacked"), ("float32", "prepacked")]


@pytest.mark.parametrize("dtype,matmuls", MATMULS)
def test_one_token_steps_and_rounds_give_bitwise_equal_logits(wide_dir, loaded, dtype, matmuls):
    """A position's logits are the same computed in a one-token step or inside a round of tau+1
    tokens, so greedy speculative output is the service's own target-only output bitwise."""
    lm = loaded(wide_dir, dtype, matmuls)
    steps, rounds, _ = steps_and_rounds(lm.engine, torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(0)).tolist())
    assert torch.equal(steps, rounds), float((steps - rounds).abs().max())


@pytest.mark.parametrize("dtype,matmuls", MATMULS)
@pytest.mark.parametrize("prefill", [False, True], ids=["chunk-with-logits", "prefill-chunk"])
def test_batch_invariance_holds_at_real_widths(real_width_dir, loaded, dtype, prefill, matmuls):
    """At the shipped target's widths, CPU GEMM kernels change with the row count (float32 here:
    1, 2-15 and 16+ rows are three classes), so a pass is padded to the calibrated lo rows and each
    matmul cuts longer inputs into blocks of lo..hi rows: a session's numbers stay its own in a
    pass of several hundred rows, a 290-token chunk among them. As a prefill chunk (no logits)
    that chunk goes first, in one product of its own: its keys and values are those of the chunk
    prefilled alone, and its batch-mates' numbers are unchanged by it. With per-row products
    nothing is padded, and the prefill chunk still has a GEMM of its own."""
    lm = loaded(real_width_dir, dtype, matmuls)
    lo, hi = lm.engine.plan.rows
    assert 1 <= lo <= 8 and hi >= 2 * lo
    eng = lm.engine
    r = random.Random(1)
    n = 40  # sessions in rounds: enough rows for two blocks or more wherever the CPU's classes end (hi <= ROW_LADDER's top)
    seqs = [[r.randrange(3, 8192) for _ in range(r.randint(20, 60))] for _ in range(n)] + [[r.randrange(3, 8192) for _ in range(300)]]
    cut = [len(s) - r.randint(1, 16) for s in seqs[:-1]] + [10]  # rounds of 1-16 tokens, and a 290-token chunk, last as the scheduler puts it
    want = [True] * n + [not prefill]

    batch = [cached(eng, s, c) for s, c in zip(seqs, cut)]
    news = [s[c:] for s, c in zip(seqs, cut)]
    assert sum(map(len, news[:-1])) > hi and len(news[-1]) > hi
    logits = eng.forward(news, batch, want)
    assert (logits[-1] is None) == prefill
    for s, c, new, kv, lg, w in zip(seqs, cut, news, batch, logits, want):
        alone_kv = cached(eng, s, c)
        (alone,) = eng.forward([new], [alone_kv], w)
        assert (alone is None and lg is None) or torch.equal(alone, lg)
        assert same_cache(alone_kv, kv, len(s))


@pytest.mark.parametrize("dtype,matmuls", MATMULS)
def test_the_heads_rows_are_not_taken_for_the_passs_own(wide_dir, loaded, dtype, matmuls):
    """A pass's first prefill chunk has a matmul product of its own (cpu/rows.py tells the pass's
    rows by their count); the output layer's rows, picked from the pass's, are not the pass's own
    even where they are as many: a round of 16 rows and k one-token steps after a chunk of 15 k
    tokens. Their logits stay bitwise those of the same rounds alone (the head's first rows went
    through the chunk's product, and differed in the last bits with per-row products)."""
    lm = loaded(wide_dir, dtype, matmuls)
    eng, V, R = lm.engine, lm.vocab_size, 16
    k = -(-(eng.plan.top + 1) // (R - 1))  # the chunk is longer than the plan's top: it goes first, in its own product
    r = random.Random(8)
    ctx = [[r.randrange(3, V) for _ in range(40)] for _ in range(k + 1)]

    def fresh():
        caches = [eng.cache(64) for _ in ctx]
        eng.forward([c[:20] for c in ctx], caches, False)
        return caches

    chunk = [r.randrange(3, V) for _ in range(k * (R - 1))]
    rounds = [ctx[0][20:20 + R]] + [c[20:21] for c in ctx[1:]]
    out = eng.forward([chunk, *rounds], [eng.cache(len(chunk)), *fresh()], [False] + [True] * len(rounds), padded=True)
    alone = eng.forward(rounds, fresh(), padded=True)
    assert out.shape[0] * out.shape[1] == len(chunk) + R + k  # the head's rows are as many as the pass's
    assert torch.equal(out, alone), float((out - alone).abs().max())


@pytest.mark.parametrize("gain,expect", [(2.0, torch.float32), (1.0, torch.bfloat16)], ids=["float32-attention", "bf16-attention"])
def test_a_half_precision_model_attends_in_the_dtype_chosen_at_load(wide_dir, gain, expect):
    """On the CPU a bf16 model keeps its cache and attends in float32 where that is ATTN_FLOAT32_GAIN
    times faster (timed at load), else in bf16 (a timer forces either here). Either way a
    position's logits are bitwise the same in a one-token step and inside a round."""
    torch.set_num_threads(1)
    lm = LM.load(wide_dir, "cpu", "bfloat16", timer=lambda what, fns: [gain, 1.0] if what == "attention" else clock(what, fns))
    assert lm.engine.plan.kv_dtype == expect
    steps, rounds, cache = steps_and_rounds(lm.engine, torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(1)).tolist())
    assert cache.layer(0)[0].dtype == expect
    assert torch.equal(steps, rounds), float((steps - rounds).abs().max())


def test_the_core_path_without_the_cpu_tier_serves_the_models_own_logits(model_dir):
    """The engine as a GPU runs it (a bare plan: no padding rows, no matmul blocks, no CPU tier),
    here on the CPU: a batched pass of prefills, rounds and steps gives the model's own logits."""
    from specdec.engine import Engine, Plan
    from specdec.engine.attention import ATTN

    torch.set_num_threads(1)
    lm = LM.load(model_dir("target"), "cpu", "float32", prepare_engine=False, check=False)
    reference = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=torch.float32).eval()
    lm.model.set_attn_implementation(ATTN)
    eng = Engine(lm.model, Plan(kv_dtype=torch.float32))
    r = random.Random(2)
    seqs = [[r.randrange(1, 16) for _ in range(r.randint(3, 40))] for _ in range(6)]
    caches = [KVCache(len(s)) for s in seqs]
    eng.forward([s[:-3] for s in seqs], caches, logits=False)
    rounds = eng.forward([s[-3:] for s in seqs], caches)
    for s, lg in zip(seqs, rounds):
        with torch.no_grad():
            want = reference(torch.tensor([s])).logits[0, -3:]
        torch.testing.assert_close(lg, want, atol=1e-5, rtol=1e-4)


def test_a_cache_takes_consecutive_pages_where_the_pool_has_them():
    """Pages come back to the pool in any order; a new cache takes the first run of consecutive free
    pages long enough for it (a session alone in its group then reads its keys as a view, no
    gather), else the lowest free ones and fresh ones after them; nothing is handed out twice."""
    from specdec.engine import Pool

    pool = Pool(torch.float32, torch.device("cpu"))
    a, b, c = pool.cache(16 * 3), pool.cache(16 * 2), pool.cache(16 * 4)
    assert a.pages == [1, 2, 3] and b.pages == [4, 5] and c.pages == [6, 7, 8, 9]
    c.release()
    a.release()
    e = pool.cache(16 * 4)
    assert e.pages == [6, 7, 8, 9]  # the run c gave back, not a's three lowest plus one
    f = pool.cache(16 * 2)
    assert f.pages == [1, 2]
    d = pool.cache(16 * 3)  # no run of 3 left: page 3, then fresh ones
    assert d.pages == [3, 10, 11]
    held = [p for x in (b, d, e, f) for p in x.pages]
    assert len(held) == len(set(held))


@pytest.mark.parametrize("dtype,matmuls", MATMULS[:1] + MATMULS[2:3])
def test_an_input_asking_for_its_last_rows_logits_gets_them_bitwise_and_alone(wide_dir, loaded, dtype, matmuls):
    """The draft's feeds need the logits after their last token only: `last` runs the output
    layer over that row (it ran over every fed row, a catch-up of 200 tokens included), with the
    numbers the whole input's logits give it."""
    lm = loaded(wide_dir, dtype, matmuls)
    eng, V = lm.engine, lm.vocab_size
    r = random.Random(3)
    seqs = [[r.randrange(3, V) for _ in range(n)] for n in (60, 7, 1)]
    head_rows = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[-2]))
    try:
        whole = eng.forward(seqs, [eng.cache(64) for _ in seqs])
        head_rows.clear()
        lasts = eng.forward(seqs, [eng.cache(64) for _ in seqs], last=[True, False, True])
    finally:
        hook.remove()
    assert head_rows[0] < sum(map(len, seqs)) and head_rows[0] >= 1 + 7 + 1
    assert lasts[0].shape == (1, V) and lasts[1].shape == (7, V) and lasts[2].shape == (1, V)
    assert torch.equal(lasts[0][0], whole[0][-1]) and torch.equal(lasts[1], whole[1]) and torch.equal(lasts[2][0], whole[2][-1])


def test_pages_given_back_are_cleared_before_a_new_owner_reads_them(model_dir):
    """From a review: a freed page kept its last owner's values, and SDPA reads a session's masked
    key positions too (weight exactly 0), so a non-finite value there (an overflow) made 0 * inf =
    NaN in another session's attention: its logits were NaN until its own writes covered the slots.
    Pages given back are zeroed at the next pass's start."""
    torch.set_num_threads(1)
    eng = LM.load(model_dir("target"), "cpu", "bfloat16", choices={"per_row": False, "attention": "model"}).engine
    a = eng.cache(64)
    eng.forward([[3] * 20], [a], logits=False)
    clean = eng.forward([[5, 6]], [a])[0]
    pages = list(a.pages)
    with torch.inference_mode():  # a session whose values overflowed: its pages hold inf when it ends
        for t in eng.pool.v:
            t.view(-1, PAGE, *t.shape[1:])[pages] = float("inf")
    a.release()
    b = eng.cache(64)
    assert b.pages == pages  # the new session takes the same pages; positions 22.. of them are never written
    eng.forward([[3] * 20], [b], logits=False)
    got = eng.forward([[5, 6]], [b])[0]
    assert torch.isfinite(got).all() and torch.equal(got, clean)
    assert all(torch.isfinite(t).all() for t in eng.pool.v)


def test_a_pass_that_fails_making_its_output_leaves_every_length_as_it_was(model_dir, monkeypatch):
    """From a review: the cache lengths moved on right after the model's call, so a failure in
    making the pass's logits (an out-of-memory on the float32 copy) left them advanced, and the
    scheduler's retry of each session alone wrote its round past where it belonged (wrong logits,
    no error). Forward's promise: a failed pass leaves every cache's length as it was."""
    torch.set_num_threads(1)
    eng = LM.load(model_dir("target"), "cpu", "float32").engine
    a, b = eng.cache(64), eng.cache(64)
    eng.forward([[3] * 10, [4] * 10], [a, b], logits=False)
    model = eng._model

    class Boom:  # the model's logits, whose float32 copy runs out of memory
        def __getitem__(self, _):
            return self

        def index_select(self, *_):
            return self

        def view(self, *_):
            return self

        def float(self):
            raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(eng, "_model", lambda *args: (model(*args), [Boom()])[1])
    for padded in (True, False):
        with pytest.raises(torch.OutOfMemoryError):
            eng.forward([[5, 6, 7], [5]], [a, b], padded=padded)
        assert (a.length, b.length) == (10, 10), padded
    monkeypatch.setattr(eng, "_model", model)
    assert eng.forward([[5, 6, 7], [5]], [a, b], padded=True).shape[:2] == (2, 3) and (a.length, b.length) == (13, 11)


def test_the_longest_round_the_verifier_takes_is_bitwise_its_steps(model_dir):
    """From a review: a chain of 64 proposals (the most a round may carry) makes a 65-row input,
    which the layout attended with the long inputs (all queries together), not a query at a time as
    steps are: its logits differed from the steps' in the last bits in float32 with the CPU tier's
    query attention. Every round the verifier takes attends a query at a time."""
    from specdec.engine.layout import GROUPS, ROW_BY_ROW
    from specdec.proposal import MAX_ROUND_TOKENS

    assert ROW_BY_ROW >= MAX_ROUND_TOKENS + 1 and GROUPS[-1] == ROW_BY_ROW
    torch.set_num_threads(1)
    eng = LM.load(model_dir("long-target"), "cpu", "float32").engine
    g = torch.Generator().manual_seed(5)
    prompt, chain = torch.randint(2, 16, (40,), generator=g).tolist(), torch.randint(2, 16, (MAX_ROUND_TOKENS + 1,), generator=g).tolist()
    a, b = eng.cache(200), eng.cache(200)
    eng.forward([prompt], [a], logits=False)
    eng.forward([prompt], [b], logits=False)
    round_ = eng.forward([chain], [a])[0]
    steps = torch.cat([eng.forward([[t]], [b])[0] for t in chain])
    assert torch.equal(round_, steps), float((round_ - steps).abs().max())


def test_free_memory_is_no_more_than_the_memory_cgroup_leaves(tmp_path):
    """From a review: in a container /proc/meminfo's MemAvailable is the node's, so the verify's
    cache budget (`auto`) was sized by the node, not the pod's limit, and its "more than the free
    memory" warning never fired: a pod past its limit was killed instead of refusing sessions.
    The cgroup's headroom (v2 and v1 layouts, here fake ones) caps it; no limit caps nothing."""
    from specdec.engine.cache import cgroup_headroom_bytes

    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("2147483648\n")
    (v2 / "kubepods" / "pod1" / "memory.current").write_text("536870912\n")
    (tmp_path / "cg2").write_text("0::/kubepods/pod1\n")
    assert cgroup_headroom_bytes(str(v2), str(tmp_path / "cg2")) == 3 << 29  # 2 GiB - 0.5 GiB
    # from the review of this change: reclaimable file cache (the checkpoint read at start-up) is not used memory
    (v2 / "kubepods" / "pod1" / "memory.stat").write_text("anon 268435456\ninactive_file 268435456\nactive_file 0\n")
    assert cgroup_headroom_bytes(str(v2), str(tmp_path / "cg2")) == 7 << 28  # 2 GiB - (0.5 - 0.25) GiB
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert cgroup_headroom_bytes(str(v2), str(tmp_path / "cg2")) is None
    (v2 / "kubepods" / "memory.max").write_text("1073741824\n")  # ... and a limit one level up counts too
    (v2 / "kubepods" / "memory.current").write_text("0\n")
    assert cgroup_headroom_bytes(str(v2), str(tmp_path / "cg2")) == 1 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "c1").mkdir(parents=True)
    (v1 / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text("1073741824\n")
    (v1 / "memory" / "docker" / "c1" / "memory.usage_in_bytes").write_text("1073741824\n")
    (tmp_path / "cg1").write_text("5:cpu:/docker/c1\n4:memory:/docker/c1\n")
    assert cgroup_headroom_bytes(str(v1), str(tmp_path / "cg1")) == 0  # at its limit
    (v1 / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_headroom_bytes(str(v1), str(tmp_path / "cg1")) is None
    assert cgroup_headroom_bytes(str(tmp_path / "none"), str(tmp_path / "missing")) is None
