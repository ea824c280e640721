"""The CPU tier: calibrated matmul row counts, per-row products, prepacked half-precision weights,
and the load-time choices (timed through an injected timer here, or pinned by --engine-choices)."""
import os
import shutil
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine import BF16_ONEDNN, logits_of_a_session
from specdec.engine import prepare
from specdec.engine.cpu import choose, kernel
from specdec.engine.cpu import prepack as prepack_mod
from specdec.choices import parse_choices
from specdec.engine.cpu.prepack import prepacked
from specdec.engine.cpu import rows as rows_mod
from specdec.engine.cpu.rows import ROW_LADDER, ROW_PROBE, class_top, per_row
from specdec.lm import LM

KERNEL = pytest.mark.skipif(kernel.library() is None, reason="the CPU tier's kernels do not build on this machine")


def test_matmul_timings_stream_several_weights_of_each_kind(model_dir):
    """A load-time timing of the matmuls runs up to STREAMED modules of each kind, from layers spread
    over the model, one after another in every call (one module over and over would time its
    weight in cache), and counts each kind as often as it occurs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=torch.float32)
    kinds = rows_mod.kinds(model)
    calls: list = []
    forward_of = lambda m: lambda x: calls.append(m)  # noqa: E731
    totals = rows_mod.matmul_seconds(model, [(forward_of, 1)], timer=lambda what, fns: [fn() or 1.0 for fn in fns])
    for ms in kinds.values():
        ran = [m for m in calls if m in ms]
        assert len(ran) == len(set(ran)) == min(len(ms), rows_mod.STREAMED) and (len(ms) == 1 or ran[-1] is not ms[0])
    # a second a call: a call's modules share it, and each kind counts as often as it occurs
    assert totals == [pytest.approx(sum(len(ms) / min(len(ms), rows_mod.STREAMED) for ms in kinds.values()))]


@pytest.mark.parametrize("seconds,pays", [([2.0, 1.0, 1.5, 1.0], True), ([1.2, 1.0, 0.8, 1.0], True), ([1.2, 1.0, 1.1, 1.0], False),
                                          ([0.9, 1.0, 0.5, 1.0], False)])
def test_per_row_products_pay_for_a_fast_step_or_for_both(model_dir, seconds, pays):
    """Per-row products are kept where a step's matmuls get 1.5x faster at a round's cost of at most
    2x, or where both a step and a round get faster (timings: a step's GEMM, a per-row step, a
    per-row round, a round's GEMM)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=torch.float32)
    assert rows_mod.per_row_pays(model, 2, rows_mod.per_row, timer=lambda what, fns: seconds) == pays


def test_row_calibration_finds_where_a_kernel_changes():
    """calibrate_rows' search, on a matmul whose results change at 1 row and from 10 rows on: every
    count up to ROW_PROBE, then the rungs of ROW_LADDER."""
    def nudged(at):  # [1, k, 16], row by row (no real GEMM, whose kernels vary too): nudged at 1 row and from `at` rows on
        return lambda x: x[..., :8] * 3.0 + (1e-3 if x.shape[1] >= at or x.shape[1] == 1 else 0.0)

    assert ROW_PROBE == 64 and ROW_LADDER == (128, 256)
    x = torch.randn(257, 16)
    assert class_top(nudged(10), x, 1) == 1
    assert class_top(nudged(10), x, 2) == 9
    assert class_top(nudged(65), x, 2) == 64
    assert class_top(nudged(100), x, 2) == 64  # between the probe's end and the first rung
    assert class_top(nudged(200), x, 2) == 128
    assert class_top(lambda x: x[..., :8] * 3.0, x, 2) == 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_products_give_a_row_the_same_numbers_at_any_row_count(dtype):
    """A per-row product (one row per batch entry) is the module's own product up to rounding,
    and gives each row bitwise the same numbers whatever the row count and wherever it sits."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    x = torch.randn(1, 40, 96).to(dtype)
    for m in (torch.nn.Linear(96, 200), torch.nn.Linear(96, 200, bias=False), Conv1D(200, 96)):
        m = m.to(dtype)
        fwd = per_row(m)
        full = fwd(x)
        torch.testing.assert_close(full, m(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        for k in (1, 2, 3, 5, 17):
            for at in (0, 7, 40 - k):
                assert torch.equal(fwd(x[:, at : at + k]), full[:, at : at + k])


@KERNEL
def test_the_row_kernel_gives_a_row_the_same_numbers_at_any_row_count():
    """The row kernel computes the module's float32 product up to rounding, bitwise the same for a
    row whatever the row count (within a block of its rows and across several) and wherever the row
    sits, with and without a bias, for GPT-2's Conv1D, and for output widths that end in a part
    panel (200 = 12 panels of 16 and 8 columns more)."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    x = torch.randn(1, 40, 96)
    conv = Conv1D(200, 96)
    torch.nn.init.normal_(conv.bias)
    with torch.inference_mode():
        for m in (torch.nn.Linear(96, 200), torch.nn.Linear(96, 200, bias=False), conv, torch.nn.Linear(96, 16)):
            fwd = kernel.row_forward(m)
            full = fwd(x)
            torch.testing.assert_close(full, m(x), rtol=1e-5, atol=1e-5)
            for k in (1, 2, 3, 4, 5, 9, 17):
                for at in (0, 7, 40 - k):
                    assert torch.equal(fwd(x[:, at : at + k]), full[:, at : at + k]), (type(m).__name__, k, at)
        assert kernel.row_forward(torch.nn.Linear(96, 200).to(torch.bfloat16)) is None  # float32 only
        fwd = kernel.row_forward(torch.nn.Linear(96, 200))
        for bad in (x.to(torch.bfloat16), x[..., :48]):  # another dtype, another width (48 divides 96): refused, not misread
            with pytest.raises(ValueError, match="the row kernel multiplies float32 CPU rows of width 96"):
                fwd(bad)


def reference_attention(q, k, v, visible, scale):
    """In float64, queries together: [B, n, H, D] over keys [B, L, H_kv, D] where visible [B, n, L]."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bnhd,blhd->bnhl", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    return torch.einsum("bnhl,blhd->bnhd", s.softmax(-1), v.double().repeat_interleave(rep, 2))


@KERNEL
@pytest.mark.parametrize("B,n,H,H_kv,D,L", [(1, 1, 8, 8, 64, 300), (3, 5, 8, 2, 64, 70), (2, 4, 4, 4, 40, 33), (1, 3, 4, 1, 128, 130),
                                         (4, 5, 4, 4, 8, 45), (2, 3, 4, 2, 16, 29)])
def test_the_query_attention_gives_a_query_the_same_numbers_in_any_batch(B, n, H, H_kv, D, L):
    """The CPU tier's query attention is attention up to rounding (against float64, as close as
    SDPA's float32), for GQA and head sizes of 8, 16, 40, 64 and 128, under causal, windowed and
    arbitrary (a tree's) masks; a query's numbers are bitwise the same attended alone, with other
    queries and sessions, with more keys past the ones it sees, and read in place from a pool where
    its keys lie scattered among others (slots)."""
    g = torch.Generator().manual_seed(B * 100 + n)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, n, H, D), (B, L, H_kv, D), (B, L, H_kv, D)))
    pos = torch.randint(L // 2, L, (B, n), generator=g)
    key = torch.arange(L)[None, None, :]
    masks = {"causal": key <= pos[:, :, None], "window": (key <= pos[:, :, None]) & (key > pos[:, :, None] - 17),
             "tree": torch.rand(B, n, L, generator=g) < 0.3}
    masks["tree"][..., 0] = True
    att = kernel.query_attention()
    for name, seen in masks.items():
        out = att(q, k, v, seen, D**-0.5).view(B, n, H, D)
        want = reference_attention(q, k, v, seen, D**-0.5)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=seen[:, None], scale=D**-0.5, enable_gqa=H != H_kv)
        tol = 4 * max(float((sdpa.transpose(1, 2).double() - want).abs().max()), 1e-7)
        assert float((out.double() - want).abs().max()) <= tol, name
        for b in range(B):
            for i in range(n):
                alone = att(q[b : b + 1, i : i + 1], k[b : b + 1], v[b : b + 1], seen[b : b + 1, i : i + 1], D**-0.5)
                assert torch.equal(alone[0], out[b, i]), (name, b, i)
        more = torch.randn(B, 24, H_kv, D, generator=g)
        padded = att(q, torch.cat([k, more], 1), torch.cat([v, more], 1), torch.cat([seen, torch.zeros(B, n, 24, dtype=torch.bool)], 2), D**-0.5)
        assert torch.equal(padded.view(B, n, H, D), out), name
        where = torch.randperm(B * L + 37, generator=g)[: B * L].view(B, L)  # each key's row in a bigger pool
        pool_k, pool_v = torch.randn(B * L + 37, H_kv, D, generator=g), torch.randn(B * L + 37, H_kv, D, generator=g)
        pool_k[where.reshape(-1)], pool_v[where.reshape(-1)] = k.reshape(-1, H_kv, D), v.reshape(-1, H_kv, D)
        slots = where.to(torch.int32)
        assert torch.equal(att(q, pool_k, pool_v, seen, D**-0.5, slots).view(B, n, H, D), out), name
        unseen = slots.masked_fill(~seen.any(1), 10**6)  # a key no query sees is never read: its slot is not checked
        assert torch.equal(att(q, pool_k, pool_v, seen, D**-0.5, unseen).view(B, n, H, D), out), name
        for outside in (B * L + 37, -1):
            with pytest.raises(IndexError, match="outside the pool"):
                att(q, pool_k, pool_v, seen, D**-0.5, slots.masked_fill(seen.any(1), outside))


@KERNEL
@pytest.mark.parametrize("D", [8, 64])
def test_the_query_attention_soft_caps_as_gemma_2_and_stays_batch_invariant(D):
    """Soft-capped attention (Gemma 2) went through two matmuls over the group's longest keys, whose
    last bits changed with a batch-mate's length (3e-7 on a tiny Gemma 2 at context 1024). The query
    attention caps each score itself: attention up to rounding (as close to float64 as transformers'
    eager order in float32), and a query's numbers are the same alone, batched, or with more keys."""
    from specdec.engine.attention import _eager

    g = torch.Generator().manual_seed(D)
    B, n, H, H_kv, L, cap, scale = 3, 4, 4, 2, 90, 5.0, 0.9  # scores large enough for the cap to bite
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, n, H, D), (B, L, H_kv, D), (B, L, H_kv, D)))
    seen = torch.arange(L)[None, None, :] <= torch.randint(L // 2, L, (B, n), generator=g)[:, :, None]
    rep = H // H_kv
    s = torch.einsum("bnhd,blhd->bnhl", q.double(), k.double().repeat_interleave(rep, 2)) * scale
    s = (torch.tanh(s / cap) * cap).masked_fill(~seen[:, :, None, :], float("-inf"))
    want = torch.einsum("bnhl,blhd->bnhd", s.softmax(-1), v.double().repeat_interleave(rep, 2))
    att = kernel.query_attention()
    out = att(q, k, v, seen, scale, None, cap).view(B, n, H, D)
    eager = _eager(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), seen[:, None], scale, cap).transpose(1, 2)
    tol = 4 * max(float((eager.double() - want).abs().max()), 1e-7)
    assert float((out.double() - want).abs().max()) <= tol
    assert not torch.allclose(out, att(q, k, v, seen, scale).view(B, n, H, D), atol=1e-3)  # the cap changed the numbers
    for b in range(B):
        alone = att(q[b : b + 1], k[b : b + 1], v[b : b + 1], seen[b : b + 1], scale, None, cap)
        assert torch.equal(alone.view(n, H, D), out[b])
    more = torch.randn(B, 300, H_kv, D, generator=g)  # a batch-mate's longer keys, none of them seen
    padded = att(q, torch.cat([k, more], 1), torch.cat([v, more], 1), torch.cat([seen, torch.zeros(B, n, 300, dtype=torch.bool)], 2),
                 scale, None, cap)
    assert torch.equal(padded.view(B, n, H, D), out)


@KERNEL
def test_a_gemma_2_sessions_numbers_do_not_depend_on_its_batch_mates_length(tmp_path):
    """A session's logits alone and beside a session of another length are bitwise equal on the
    CPU (DESIGN §9); with attention soft-capping they differed in the last bits (the batch's longest
    keys set the matmuls' shapes)."""
    import random

    from helpers import archmodels

    cfg_cls, model_cls, kw, _ = archmodels.SPECS["gemma2"]
    torch.manual_seed(0)
    model_cls(cfg_cls(**dict(kw, max_position_embeddings=1024))).eval().save_pretrained(tmp_path / "g")
    archmodels.word_tokenizer(archmodels.V).save_pretrained(tmp_path / "g")
    torch.set_num_threads(1)
    lm = LM.load(str(tmp_path / "g"), "cpu", "float32")
    eng, r = lm.engine, random.Random(11)
    ids = lambda n: [r.randrange(2, archmodels.V) for _ in range(n)]  # noqa: E731
    for la, lb in ((33, 700), (5, 1000), (100, 500)):
        a, b = eng.cache(la + 8), eng.cache(lb + 8)
        eng.forward([ids(la)], [a], logits=False)
        eng.forward([ids(lb)], [b], logits=False)
        rnd = ids(3)
        alone = eng.forward([rnd], [a])[0]
        a.crop(la)
        both = eng.forward([rnd, [5]], [a, b])[0]
        assert torch.equal(alone, both), (la, lb, float((alone - both).abs().max()))
        a.release()
        b.release()


@KERNEL
def test_the_query_attentions_eight_key_scores_are_its_one_key_scores():
    """A head of 24 floats scores keys eight at a time with one shared reduction (hsum8), a head of
    32 four at a time, each reduced alone (hsum): the same additions, so a head of 24 padded with
    zeros to 32 gives bitwise the same outputs, for every count of visible keys (blocks and tails)."""
    g = torch.Generator().manual_seed(7)
    B, n, H, L = 2, 3, 4, 41
    q, k, v = (torch.randn(B, x, H, 24, generator=g) for x in (n, L, L))
    pad = lambda t: torch.nn.functional.pad(t, (0, 8))  # noqa: E731
    att = kernel.query_attention()
    for m in range(1, L + 1):
        seen = torch.zeros(B, n, L, dtype=torch.bool)
        seen[..., :m] = True
        short, wide = att(q, k, v, seen, 0.2), att(pad(q), pad(k), pad(v), seen, 0.2)
        assert torch.equal(short, wide[..., :24]), m


@KERNEL
def test_the_query_attention_leaves_heads_it_does_not_take_to_sdpa():
    """Heads the kernel does not take come back as None (the pass attends them through SDPA): another
    dtype, a head size that is not a multiple of 8, values of another size than keys; a visible
    mask of the wrong shape is an error. A NaN in a query's scores stays NaN."""
    att = kernel.query_attention()
    q, k, seen = torch.randn(1, 2, 4, 64), torch.randn(1, 9, 4, 64), torch.ones(1, 2, 9, dtype=torch.bool)
    assert att(q, k, k, seen, 0.125) is not None
    assert att(q.bfloat16(), k.bfloat16(), k.bfloat16(), seen, 0.125) is None
    assert att(q[..., :36], k[..., :36], k[..., :36], seen, 0.125) is None
    assert att(q, k, k[..., :32], seen, 0.125) is None
    with pytest.raises(ValueError, match="visible keys"):
        att(q, k, k, seen[:, :, :8], 0.125)
    with pytest.raises(ValueError, match="slots"):
        att(q, k[0], k[0], seen, 0.125, torch.arange(9).view(1, 9))  # int64 slots
    bad = q.clone()
    bad[0, 1, 2, 5] = float("nan")  # a failed score shows as NaN (the verifier then refuses the row), not as a plausible mean
    out = att(bad, k, k, seen, 0.125).view(1, 2, 4, 64)
    assert out[0, 1, 2].isnan().all() and not out[0, 0].isnan().any() and not out[0, 1, :2].isnan().any()


@KERNEL
def test_a_half_precision_caches_dtype_is_timed_against_the_query_attention(monkeypatch):
    """The float32 contender of the cache-dtype timing attends through the query attention (unless
    pinned off), and computes what SDPA in the model's dtype computes, to bf16 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                         intermediate_size=32, vocab_size=64)).to(torch.bfloat16)
    calls = []
    real = kernel.query_attention

    def counted():
        att = real()
        return lambda *a: calls.append(1) or att(*a)

    monkeypatch.setattr(kernel, "query_attention", counted)

    def timer(what, fns):
        own, wide = (f() for f in fns)
        torch.testing.assert_close(wide.float().reshape(own.shape), own.float(), rtol=2e-2, atol=2e-2)  # [1, H, D] in [1, H, 1, D]'s order
        return [1.0, 1.0]

    assert choose.faster_attention(model, timer=timer) == torch.bfloat16 and len(calls) == 2  # the probe, then the timed call
    calls.clear()
    assert choose.faster_attention(model, timer=timer, query=False) == torch.bfloat16 and not calls


@KERNEL
def test_the_row_kernel_packs_a_bf16_checkpoints_weights_in_bf16_with_the_same_numbers():
    """A float32 weight whose values are all bfloat16 values (a bf16 checkpoint loaded in float32)
    is packed in bfloat16, half the bytes, and its products are bitwise the float32 panels' at any
    row count, for a part panel, a bias and GPT-2's Conv1D; a weight with one value off bfloat16's
    grid keeps float32 panels."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(4)
    conv = Conv1D(200, 96)
    with torch.inference_mode():
        for m in (torch.nn.Linear(96, 200), torch.nn.Linear(512, 1408, bias=False), conv):
            m.weight.copy_(m.weight.bfloat16().float())
            half, full = kernel.row_forward(m), kernel.row_forward(m, half=False)
            assert (half.packed.dtype, full.packed.dtype) == (torch.bfloat16, torch.float32)
            assert half.packed.float().equal(full.packed)
            x = torch.randn(13, m.weight.shape[1] if isinstance(m, torch.nn.Linear) else m.weight.shape[0])
            for rows in (1, 2, 5, 6, 7, 13):
                assert torch.equal(half(x[:rows]), full(x[:rows])), (type(m).__name__, rows)
            torch.testing.assert_close(half(x), m(x), rtol=1e-5, atol=1e-5)
        off = torch.nn.Linear(96, 40)
        off.weight.copy_(off.weight.bfloat16().float())
        off.weight[3, 7] = 1.0 + 2.0**-10  # between two bfloat16 values (7 bits of mantissa)
        assert kernel.row_forward(off).packed.dtype == torch.float32
        # bits, not values: the smallest subnormal is no bfloat16 value, a negative zero is one
        assert not kernel.bf16_exact(torch.tensor([0.5, 2.0**-149])) and kernel.bf16_exact(torch.tensor([0.5, -0.0]))


@KERNEL
def test_a_bf16_checkpoint_in_float32_streams_bf16_panels_with_the_float32_numbers(tmp_path, monkeypatch, caplog):
    """The shipped pair's case: a model saved in bf16 and served in float32 packs every weight in
    bfloat16 (logged), and a pass of several sessions gives bitwise the logits of the same model
    with float32 panels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tinymodels import word_tokenizer

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    word_tokenizer(256).save_pretrained(tmp_path)
    pin = parse_choices("fp32-prepack=off,per-row=on,row-kernel=on")
    with caplog.at_level("INFO", logger="specdec.engine"):
        half = LM.load(str(tmp_path), "cpu", "float32", choices=pin)
    assert any("through the row kernel, 15 of 15 weights packed in bfloat16" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(kernel, "bf16_exact", lambda w: False)
    caplog.clear()
    with caplog.at_level("INFO", logger="specdec.engine"):
        full = LM.load(str(tmp_path), "cpu", "float32", choices=pin)
    assert any("through the row kernel, 0 of 15 weights packed in bfloat16" in r.getMessage() for r in caplog.records)
    inputs = [[5, 6, 7, 8, 9], [10], [11, 12, 13]]
    got = []
    for lm in (half, full):
        caches = [lm.engine.cache(64) for _ in inputs]
        for i, c in enumerate(caches):
            lm.engine.forward([[3 + i, 4, 5, 6]], [c], False)
        got.append(lm.engine.forward(inputs, caches))
    assert all(torch.equal(a, b) for a, b in zip(*got))


@KERNEL
def test_the_kernels_give_the_same_numbers_at_any_thread_count():
    """Both kernels run on torch's thread count, each output whole on one thread: the row kernel's
    products (output widths that end in a part panel, 1 to 13 rows) and the query attention's
    (sessions, rounds, GQA, a tree's mask) are bitwise the same on 1, 2 and 3 threads."""
    g = torch.Generator().manual_seed(3)
    mods = [torch.nn.Linear(96, 200), torch.nn.Linear(300, 1000, bias=False)]
    xs = [torch.randn(13, m.in_features, generator=g) for m in mods]
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((3, 5, 8, 64), (3, 90, 2, 64), (3, 90, 2, 64)))
    seen = torch.rand(3, 5, 90, generator=g) < 0.5
    att = kernel.query_attention()
    threads = torch.get_num_threads()
    outs = {}
    try:
        with torch.inference_mode():
            fwds = [kernel.row_forward(m) for m in mods]
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                outs[n] = [fwd(x[:rows]) for fwd, x in zip(fwds, xs) for rows in (1, 5, 13)] + [att(q, k, v, seen, 0.125)]
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[n])), n
    cc = kernel._compiler()
    if cc and "gcc" in subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.lower():
        assert kernel.threaded()  # gcc takes -fopenmp: the test above ran threads, not one thread three times
    torch.testing.assert_close(outs[1][2], mods[0](xs[0]).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("gcc") is None or kernel._unsupported() is not None, reason="needs gcc, on x86-64 Linux with AVX2")
def test_a_compiler_without_openmp_builds_the_kernels_for_one_thread(monkeypatch, tmp_path, caplog):
    """A compiler that refuses -fopenmp (clang without libomp, say) still builds the kernels, without
    OpenMP: logged, and they run on one thread whatever torch's thread count, with the same numbers."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "cc: error: unsupported option -fopenmp" >&2; exit 1; }; done\n'
                  'exec gcc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path / "package")  # nothing prebuilt
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    m, x = torch.nn.Linear(64, 40), torch.randn(3, 64)
    threads = torch.get_num_threads()
    kernel.library.cache_clear()
    try:
        with caplog.at_level("INFO", logger="specdec.engine"):
            assert kernel.library() is not None and not kernel.threaded()
        assert any("built without OpenMP (with -fopenmp, " in r.getMessage() and "unsupported option -fopenmp" in r.getMessage()
                   for r in caplog.records)
        assert any("kernels run on one thread whatever --threads says" in r.getMessage() for r in caplog.records)
        torch.set_num_threads(2)
        with torch.inference_mode():
            torch.testing.assert_close(kernel.row_forward(m)(x), m(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
        kernel.library.cache_clear()  # the next caller loads the real one


@pytest.mark.skipif(not kernel.avx512(), reason="the CPU has no AVX-512F (or the kernels do not build here)")
def test_the_row_kernels_avx512_code_gives_the_avx2_codes_numbers():
    """Where the CPU has AVX-512F the row kernel's products run its AVX-512 code (12 rows a read of
    a panel, not 6): every output is the same chain of fused multiply-adds, so bitwise the AVX2
    code's, for float32 and bfloat16 panels, part panels and row counts across its blocks."""
    g = torch.Generator().manual_seed(4)
    mods = [torch.nn.Linear(96, 200), torch.nn.Linear(300, 37, bias=False)]
    mods[0].weight.data = mods[0].weight.data.bfloat16().float()  # bfloat16 panels
    outs = {}
    try:
        with torch.inference_mode():
            fwds = [kernel.row_forward(m) for m in mods]
            assert fwds[0].packed.dtype == torch.bfloat16 and fwds[1].packed.dtype == torch.float32
            xs = [torch.randn(29, m.in_features, generator=g) for m in mods]
            for wide in (True, False):
                assert kernel.avx512(wide) == wide
                outs[wide] = [fwd(x[:rows]) for fwd, x in zip(fwds, xs) for rows in (1, 5, 12, 13, 29)]
    finally:
        kernel.avx512(True)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    with torch.no_grad():
        torch.testing.assert_close(outs[True][4], mods[0](xs[0].clone()), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("gcc") is None or kernel._unsupported() is not None, reason="needs gcc, on x86-64 Linux with AVX2")
def test_a_build_leaves_the_cache_its_newest_libraries(monkeypatch, tmp_path):
    """Each version of the sources builds a library of its own into the cache folder; a build
    leaves there the KEEP_BUILDS newest, itself among them, and nothing else in the folder is
    touched."""
    monkeypatch.setenv("CC", "gcc")
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path / "package")  # nothing prebuilt
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    old = [tmp_path / f"kernels-{i:016x}.so" for i in range(6)]
    for age, p in enumerate(old):  # old[0] the newest of them
        p.write_bytes(b"an older build")
        os.utime(p, (1e9 - age, 1e9 - age))
    (tmp_path / "notes.txt").write_text("not a library")
    kernel.library.cache_clear()
    try:
        assert kernel.library() is not None
    finally:
        kernel.library.cache_clear()  # the next caller loads the real one
    left = sorted(p.name for p in tmp_path.glob("kernels-*.so"))
    assert len(left) == kernel.KEEP_BUILDS and {p.name for p in old[: kernel.KEEP_BUILDS - 1]} < set(left)
    assert (tmp_path / "notes.txt").exists()


@pytest.mark.skipif(shutil.which("gcc") is None or kernel._unsupported() is not None, reason="needs gcc, on x86-64 Linux with AVX2")
def test_the_cache_keeps_the_libraries_used_last(monkeypatch, tmp_path):
    """A library loaded from the cache counts as used then: a later build's prune keeps it over
    libraries built after it and not used since."""
    monkeypatch.setenv("CC", "gcc")
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path / "package")
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    kernel.library.cache_clear()
    try:
        assert kernel.library() is not None  # builds this version's library
        mine = next(tmp_path.glob("kernels-*.so"))
        os.utime(mine, (1e9 - 100, 1e9 - 100))  # built long ago ...
        newer = [tmp_path / f"kernels-{i:016x}.so" for i in range(kernel.KEEP_BUILDS + 1)]
        for p in newer:  # ... and as many others built since as the cache keeps
            p.write_bytes(b"a build of other sources")
            os.utime(p, (1e9, 1e9))
        kernel.library.cache_clear()
        assert kernel.library() is not None  # loaded from the cache: used now
        kernel._prune(newer[0])  # what another version's build runs
        assert mine.exists()
        assert len(list(tmp_path.glob("kernels-*.so"))) == kernel.KEEP_BUILDS
    finally:
        kernel.library.cache_clear()  # the next caller loads the real one


def test_a_cache_folder_that_cannot_hold_code_is_not_built_into_at_every_start(monkeypatch, tmp_path):
    """From a review: on a noexec mount no library loads from the cache folder, and the rebuild of
    one that did not load ran at every start (seconds each), to end with the kernels off all the
    same. A load refused for the folder's sake is not built again."""
    monkeypatch.setenv("CC", shutil.which("cc") or shutil.which("gcc") or "cc")
    monkeypatch.setattr(kernel, "_compiler", lambda: ("cc", "a compiler"))
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path / "package")
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    source = b"".join(src.read_bytes() for src in kernel.SOURCES)
    (tmp_path / f"kernels-{kernel._key(source, 'cc', 'a compiler')}.so").write_bytes(b"a build")

    def refused(path, *a, **k):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(kernel.ctypes, "CDLL", refused)
    monkeypatch.setattr(kernel, "_build", lambda *a: pytest.fail("built again"))
    with pytest.raises(OSError, match="map segment"):
        kernel._load()


@pytest.mark.skipif(shutil.which("gcc") is None or kernel._unsupported() is not None, reason="needs gcc, on x86-64 Linux with AVX2")
def test_a_cached_library_that_does_not_load_is_built_again_and_a_killed_builds_file_pruned(monkeypatch, tmp_path):
    """From a review: a cached library that failed to load (cut short, or built against another
    runtime) turned the kernels off at every start until someone removed it by hand; a build
    killed part-way left its temporary file for good. The first is built again, the second pruned
    once older than a build may take; and the library names libm, whose tanhf attend.c calls."""
    monkeypatch.setenv("CC", "gcc")
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path / "package")
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    source = b"".join(src.read_bytes() for src in kernel.SOURCES)
    mine = tmp_path / f"kernels-{kernel._key(source, *kernel._compiler())}.so"  # the path this process's build would take
    mine.write_bytes(b"junk")  # cut short
    kernel.library.cache_clear()
    try:
        killed = tmp_path / f"{kernel.TMP_PREFIX}abc.so"
        killed.write_bytes(b"half a build")
        os.utime(killed, (1e9, 1e9))
        kernel.library.cache_clear()
        assert kernel.library() is not None and mine.stat().st_size > 1000
        assert not killed.exists()  # pruned by the load (not only after a fresh build)
        needed = subprocess.run(["readelf", "-d", str(mine)], capture_output=True, text=True) if shutil.which("readelf") else None
        if needed is not None:
            assert "libm.so" in needed.stdout, needed.stdout
    finally:
        kernel.library.cache_clear()  # the next caller loads the real one


def test_the_prebuild_on_a_machine_the_kernels_are_not_for_succeeds_with_a_word(monkeypatch, capsys):
    """From a review: the draft image's prebuild exited 1 on arm64 (gcc has no -mavx2 there), so
    the image did not build; the services run without the kernels there, and now so does it."""
    monkeypatch.setattr(kernel.platform, "machine", lambda: "aarch64")
    assert kernel.main() == 0
    assert "nothing to build: it is built for x86-64 Linux, not aarch64" in capsys.readouterr().out


def test_a_row_kernel_that_does_not_build_is_logged_and_left_out(monkeypatch, tmp_path, caplog):
    """A compiler that fails leaves no library behind and one logged reason; the CPU tier then
    makes per-row products as batched matmuls."""
    monkeypatch.setenv("CC", "false")  # on PATH, and exits 1
    monkeypatch.setattr(kernel, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernel, "_unsupported", lambda: None)  # as on an x86-64 Linux host with AVX2, wherever this runs
    kernel.library.cache_clear()
    try:
        with caplog.at_level("INFO", logger="specdec.engine"):
            assert kernel.library() is None
        assert any("CPU tier's kernels not used: it did not build or load (false exited 1" in r.getMessage() for r in caplog.records)
        assert list(tmp_path.iterdir()) == []  # the failed build's temporary file is gone
    finally:
        kernel.library.cache_clear()  # the next caller builds (or finds) the real one


@KERNEL
def test_a_library_prebuilt_with_the_package_loads_without_a_compiler(monkeypatch, tmp_path, capsys):
    """`python -m specdec.engine.cpu.kernel` (the draft image's build stage) builds the library into
    the package, readable by every user; a runtime with no compiler then loads it, and builds
    nothing in its cache."""
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path)
    assert kernel.main() == 0
    (built,) = tmp_path.glob("kernels-prebuilt-*.so")
    out = capsys.readouterr().out.strip()  # a compiler without OpenMP (clang without libomp) says so
    assert out in (f"built {built}", f"built {built} (without OpenMP: the kernels run on one thread)"), out
    assert built.stat().st_mode & 0o777 == 0o755
    monkeypatch.setattr(kernel, "_compiler", lambda: None)
    monkeypatch.setattr(kernel, "_cache_dir", lambda: pytest.fail("a prebuilt library was built again"))
    kernel.library.cache_clear()
    try:
        m = torch.nn.Linear(64, 40)
        x = torch.randn(3, 64)
        with torch.inference_mode():
            torch.testing.assert_close(kernel.row_forward(m)(x), m(x), rtol=1e-5, atol=1e-5)
        assert kernel.query_attention() is not None
    finally:
        kernel.library.cache_clear()


def test_without_a_compiler_or_a_prebuilt_library_the_kernels_are_left_out(monkeypatch, tmp_path, caplog, capsys):
    """No compiler and nothing prebuilt: one logged reason, and the prebuild command says why it
    built nothing."""
    monkeypatch.setattr(kernel, "_package_dir", lambda: tmp_path)
    monkeypatch.setattr(kernel, "_compiler", lambda: None)
    monkeypatch.setattr(kernel, "_unsupported", lambda: None)  # as on an x86-64 Linux host with AVX2, wherever this runs
    monkeypatch.delenv("CC", raising=False)
    kernel.library.cache_clear()
    try:
        with caplog.at_level("INFO", logger="specdec.engine"):
            assert kernel.library() is None
        assert any("no C compiler (cc or gcc) on PATH, and none prebuilt with the package" in r.getMessage() for r in caplog.records)
    finally:
        kernel.library.cache_clear()
    assert kernel.main() == 1 and "not built: no C compiler (cc or gcc) on PATH" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("why", [pytest.param("memory", marks=KERNEL), "unbuilt", pytest.param("pinned off", marks=KERNEL)])
def test_per_row_products_without_the_row_kernel(model_dir, monkeypatch, caplog, why):
    """Where the row kernel's packed weights would not fit in a quarter of the free memory, where
    it is not built, or where it is pinned off, float32 per-row products are batched matmuls, and
    the logged choices say row-kernel=off."""
    if why == "memory":
        monkeypatch.setattr(choose, "available_memory_bytes", lambda: 1024)
    elif why == "unbuilt":
        monkeypatch.setattr(kernel, "library", lambda: None)
    torch.set_num_threads(1)
    pins = dict(per_row=True, **({"row_kernel": False} if why == "pinned off" else {}))
    with caplog.at_level("INFO", logger="specdec.engine"):
        lm = LM.load(model_dir("target"), "cpu", "float32", check=False, choices=pins, timer=refuse_timing)
    assert not lm.engine.plan.row_kernel and lm.engine.plan.made["row-kernel"] == "off"
    said = [r.getMessage() for r in caplog.records]
    assert any("the row kernel not used: its packed weights'" in m for m in said) == (why == "memory")
    assert any("per-row=on pinned without row-kernel; made row-kernel=off" in m for m in said) == (why != "pinned off")


@KERNEL
def test_the_row_kernels_memory_budget_counts_bfloat16_panels_at_their_size(monkeypatch):
    """The row kernel's packed weights take 2 bytes a weight where a weight's values are all
    bfloat16 values (a bf16 checkpoint served in float32: its panels are bfloat16) and 4 elsewhere;
    the memory budget counts them so: a host with room for the halves but not for float32 copies
    takes the kernel for the bf16-exact model, whose panels are then bfloat16, and refuses it for
    the other."""
    g = torch.Generator().manual_seed(0)
    class Model(torch.nn.Sequential):
        dtype = torch.float32  # as a transformers model says

    exact, plain = (Model(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)) for _ in range(2))
    for m in exact:
        m.weight.data = torch.randn(m.weight.shape, generator=g).bfloat16().float()
    weights = sum(m.weight.numel() for m in plain)
    monkeypatch.setattr(choose, "available_memory_bytes", lambda: int(3 * weights / choose.PREPACK_MEMORY_SHARE))  # 3 bytes a weight
    tested = []
    real = kernel.bf16_exact
    monkeypatch.setattr(kernel, "bf16_exact", lambda w: tested.append(w.shape) or real(w))
    make = choose.kernel_products(exact, None)
    assert make is not None and all(make(m).packed.dtype == torch.bfloat16 for m in exact)
    assert len(tested) == len(exact)  # each weight's bits tested once, for the budget and the packing both
    assert choose.kernel_products(plain, None) is None


def test_per_row_products_keep_one_copy_of_each_weight(wide_dir):
    """Switching to per-row products transposes each weight once and keeps only that copy (the
    original is freed; a weight tied to the embeddings stays, and its transposed copy is the one
    extra), and the model's own forward still gives its logits."""
    import gc
    import weakref

    torch.set_num_threads(1)
    model = LM.load(wide_dir, "cpu", "float32", check=False, prepare_engine=False).model
    ids = torch.tensor([[5, 9, 13, 40, 7]])
    with torch.inference_mode():
        want = model(ids).logits
    embedding = model.get_input_embeddings().weight
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    originals = [(weakref.ref(m.weight), m.weight is embedding) for m in linears]
    prepare(model, per_row=True, row_kernel=False)  # the row kernel packs a copy and keeps the weight (below)
    gc.collect()
    assert [w() is None for w, tied in originals] == [not tied for _, tied in originals]
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
def test_prepacked_products_are_the_modules_own_numbers():
    """A prepacked product (the weight reordered once for oneDNN) gives bitwise the numbers of the
    module's own bf16 product, at any row count, with and without a bias, and for GPT-2's Conv1D."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    x = torch.randn(1, 40, 96).to(torch.bfloat16)
    conv = Conv1D(200, 96)
    torch.nn.init.normal_(conv.bias)  # zeros by default: a dropped bias would pass unseen
    with torch.inference_mode():
        for m in (torch.nn.Linear(96, 200), torch.nn.Linear(96, 200, bias=False), conv):
            m = m.to(torch.bfloat16)
            fwd = prepacked(m)
            for k in (1, 2, 3, 5, 17, 40):
                assert torch.equal(fwd(x[:, :k]), m(x[:, :k])), (type(m).__name__, k)


PINS = [("float32", "fp32-prepack=off,per-row=on,row-kernel=off,attention-kernel=off"),
        pytest.param("float32", "fp32-prepack=off,per-row=on,row-kernel=on,attention-kernel=on", marks=KERNEL),
        pytest.param("float32", "fp32-prepack=off,per-row=off,attention-kernel=on", marks=KERNEL),
        ("float32", "fp32-prepack=on,per-row=off,attention-kernel=off"),
        ("bfloat16", "attention=model,prepack=off,per-row=off"),
        pytest.param("bfloat16", "attention=float32,prepack=on,per-row=off,attention-kernel=off",
                     marks=pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU"))]


def refuse_timing(what, fns):
    raise AssertionError(f"a pinned choice was timed: {what}")


@pytest.mark.parametrize("dtype,pin", PINS)
def test_pinned_engine_choices_are_made_as_given_without_timing(model_dir, dtype, pin):
    """--engine-choices: each pinned choice is made as given (where its checks pass, as they do
    here), with no timing at all; two loads with the same pins compute bitwise the same logits."""
    torch.set_num_threads(1)
    lms = [LM.load(model_dir("target"), "cpu", dtype, choices=parse_choices(pin), timer=refuse_timing) for _ in range(2)]
    assert [lm.engine.plan.choices() for lm in lms] == [pin, pin]
    assert torch.equal(logits_of_a_session(lms[0].engine), logits_of_a_session(lms[1].engine))


INF = float("inf")
OUTCOMES = [  # dtype, attention timed faster in float32, prepack gain timed, per-row products timed to pay, GEMMs calibrate
    ("float32", None, None, True, True), ("float32", None, None, False, True), ("float32", None, None, True, False),
    ("float32", None, 2.0, False, True),  # prepacked products kept: a step and a pass both timed twice as fast
    ("bfloat16", True, 2.0, False, True), ("bfloat16", False, 1.0, True, True), ("bfloat16", False, 1.0, False, True),
    ("bfloat16", True, 2.0, True, False),  # prepacking kept, then undone: no GEMM row counts agree
]


@pytest.mark.parametrize("dtype,fp32_attention,gain,pays,gemms", OUTCOMES)
def test_a_timed_loads_choices_pinned_give_its_numbers(model_dir, monkeypatch, dtype, fp32_attention, gain, pays, gemms):
    """Whatever the timings decide (a timer forces one outcome each), the choices a load logs, pinned
    at the next load, are made again without timing and give bitwise the same logits."""
    def timer(what, fns):  # seconds per call of each contender: the first is the plain one
        if what == "attention":  # the model's dtype, then float32
            return [2.0, 1.0] if fp32_attention else [1.0, 1.0]
        if what == "prepack":  # plain, then prepacked
            return [gain or 1.0, 1.0]
        assert what == "per-row"  # a step's lo-row GEMM, a per-row step, a per-row round, a round's GEMM
        return [2.0, 1.0, 1.0, 1.0] if pays else [1.0, 1.0, 1.0, 1.0]

    if not gemms:
        real = choose.calibrate_rows
        monkeypatch.setattr(choose, "calibrate_rows", lambda model, seeds=2, **kw: real(model, seeds, **kw) if kw else None)
    torch.set_num_threads(1)
    timed = LM.load(model_dir("target"), "cpu", dtype, timer=timer)
    chosen = timed.engine.plan.choices()
    if dtype == "bfloat16":
        assert chosen.startswith(f"attention={'float32' if fp32_attention else 'model'},")
        if BF16_ONEDNN:
            assert ("prepack=on" in chosen) == (gain == 2.0 and gemms), chosen  # kept, or undone where no GEMM rows agree
    else:
        assert ("fp32-prepack=on" in chosen) == (gain == 2.0), chosen  # float32: kept where a step and a pass are timed to pay
    pinned = LM.load(model_dir("target"), "cpu", dtype, choices=parse_choices(chosen), timer=refuse_timing)
    assert pinned.engine.plan.choices() == chosen
    assert pinned.engine.plan.rows == timed.engine.plan.rows
    assert torch.equal(logits_of_a_session(pinned.engine), logits_of_a_session(timed.engine))


def test_engine_choices_parse_and_refuse():
    assert parse_choices("") == {} and parse_choices(None) == {}
    assert parse_choices(" attention=float32 , prepack=off,per-row=on") == {"attention": "float32", "prepack": False, "per_row": True}
    for bad in ("prepack", "prepack=yes", "attention=bfloat16", "rows=4", "per-row=on,per-row=off", "prepack=on,per-row=on",
                "fp32-prepack=on,per-row=on"):
        with pytest.raises(ValueError, match="--engine-choices"):
            parse_choices(bad)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
@pytest.mark.parametrize("timings,kept", [([1.0, 2.0, 2.0, 2.0], True), ([1.0] * 6, False)])
def test_a_prepacking_that_misses_the_bar_is_timed_again(tied_dir, monkeypatch, timings, kept):
    """One slow timing (a loaded machine) does not drop the prepacking: up to PREPACK_TRIES tries
    of (step, round) gains, kept at the first that clears PREPACK_GAIN."""
    gains = iter(timings)
    tries = []
    monkeypatch.setattr(prepack_mod, "matmul_seconds", lambda model, runs, timer=None, what="": tries.append(1) or [next(gains), 1.0])
    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False, prepare_engine=False).model
    assert (prepack_mod.prepack(model) is not None) == kept
    assert len(tries) == (4 if kept else 2 * prepack_mod.PREPACK_TRIES)  # a step and a round per try: bad, then good
@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
def test_modules_that_share_a_weight_share_its_packed_copy(monkeypatch):
    """Two Linear modules holding one weight (each with a bias of its own) get one packed copy of
    it between them, counted once against the memory share; a module with a weight of its own gets
    its own. Each module keeps its own bias."""
    class Shared(torch.nn.Module):
        dtype = torch.bfloat16

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(64, 96) for _ in range(3))
            self.b.weight = self.a.weight

    torch.manual_seed(0)
    model = Shared().to(torch.bfloat16)
    made = []
    monkeypatch.setattr(prepack_mod, "packed_weight", lambda m, real=prepack_mod.packed_weight: made.append(m) or real(m))
    # two distinct bf16 weights take 24,576 bytes and fit in a quarter of 120,000; three (36,864) would not
    monkeypatch.setattr(prepack_mod, "available_memory_bytes", lambda device=None: 120_000)
    out = prepack_mod.prepack(model, force=True)
    assert out is not None
    former, rows = out
    assert set(former) == {model.a, model.b, model.c} and rows is None  # half precision calibrates after, in choose()
    assert len(made) == 2 and {model.a, model.b} & set(made) and model.c in made
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        for m in (model.a, model.b, model.c):
            assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
def test_prepacked_matmuls_keep_the_models_numbers_and_its_weights(tied_dir, monkeypatch):
    """bf16 on the CPU: after prepacking, the model's own forward gives bitwise the logits it gave
    before, and its plain weights are all still there (whatever reads one directly gets the right
    numbers). Where the packed copies would not fit in a quarter of the free memory, nothing is packed."""
    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False, prepare_engine=False).model
    ids = torch.tensor([[5, 9, 13, 40, 7]])
    with torch.inference_mode():
        want = model(ids).logits
    weights = {n: p.clone() for n, p in model.named_parameters()}
    assert prepare(model, prepack=True).plan.prepacked
    assert {n: p for n, p in model.named_parameters()}.keys() == weights.keys()
    assert all(p.device.type == "cpu" and torch.equal(p, weights[n]) for n, p in model.named_parameters())
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)

    monkeypatch.setattr(prepack_mod, "available_memory_bytes", lambda device=None: 1 << 20)  # 1 MiB free
    small = LM.load(tied_dir, "cpu", "bfloat16", check=False, prepare_engine=False).model
    assert not prepare(small, prepack=True).plan.prepacked


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: nothing is prepacked, so nothing is undone")
def test_prepacking_is_undone_where_no_row_counts_agree(tied_dir, monkeypatch):
    """If the prepacked GEMMs calibrate to no row counts, the modules go back to their plain
    forwards, so per-row products can be tried."""
    real, packed = choose.calibrate_rows, choose.prepack_weights
    monkeypatch.setattr(choose, "calibrate_rows", lambda model, seeds=2, **kw: real(model, seeds, **kw) if kw else None)
    made = []
    monkeypatch.setattr(choose, "prepack_weights", lambda *args, **kw: made.append(packed(*args, **kw)) or made[-1])
    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False, prepare_engine=False).model
    plan = prepare(model, prepack=True).plan
    assert made and made[0] is not None  # the weights were prepacked ...
    assert not plan.prepacked  # ... and that was undone
    assert all(p.device.type == "cpu" for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if plan.rows is None:  # per-row products did not calibrate either: the plain modules serve
        assert all(m.forward.__func__ is type(m).forward for m in linears)
    else:  # per-row products were kept
        assert plan.rows[0] == 1




def test_an_engine_choice_prepare_does_not_know_is_an_error():
    """prepare() takes the pins by parse_choices' keywords; a misspelt one is refused before
    anything is loaded or timed, naming the choices it knows."""
    with pytest.raises(TypeError, match=r"no engine choice per_rows \(the choices: attention, prepack, fp32_prepack, per_row"):
        prepare(None, per_rows=True)


@pytest.mark.parametrize("bf16,kernel_runs,free_gib,want", [
    (False, True, 64, torch.float32),  # no bf16 instructions: float32
    (True, True, 64, torch.float32),  # the row kernel: float32, whose panels read a bf16 checkpoint at its bytes
    (True, True, 1, torch.bfloat16),  # ... unless float32 weights and panels would not fit in half the free memory
    (True, False, 64, torch.bfloat16),  # no row kernel: bf16 instructions, bfloat16
])
def test_auto_dtype_on_the_cpu(monkeypatch, bf16, kernel_runs, free_gib, want):
    """`--dtype auto` on the CPU: float32 where the row kernel runs and the weights in float32 with
    their panels (a bf16 checkpoint: bfloat16 panels, 3x its bytes; a float32 one: float32 panels,
    2x) fit in 40% of the free memory; else bfloat16 where the CPU has bf16 instructions; else
    float32. Named dtypes are taken as they are."""
    from specdec import lm as lm_mod

    monkeypatch.setattr(lm_mod, "cpu_has_native_bf16", lambda: bf16)
    monkeypatch.setattr(lm_mod, "cpu_row_kernel", lambda: kernel_runs)
    monkeypatch.setattr(lm_mod, "available_memory_bytes", lambda: free_gib * 2**30)
    cpu = torch.device("cpu")
    assert lm_mod.resolve_dtype("auto", cpu, torch.bfloat16, 2**30 // 2) == want  # a 0.5 GiB bf16 checkpoint: 1.5 GiB so
    # a 0.3 GiB float32 checkpoint takes float32 panels, 0.6 GiB so: past 40% of 1 GiB free, within 40% of 2
    monkeypatch.setattr(lm_mod, "available_memory_bytes", lambda: 2**30)
    assert lm_mod.resolve_dtype("auto", cpu, torch.float32, int(0.3 * 2**30)) == (torch.bfloat16 if bf16 else torch.float32)
    monkeypatch.setattr(lm_mod, "available_memory_bytes", lambda: 2 * 2**30)
    assert lm_mod.resolve_dtype("auto", cpu, torch.float32, int(0.3 * 2**30)) == (torch.float32 if kernel_runs or not bf16 else torch.bfloat16)
    assert lm_mod.resolve_dtype("auto", cpu, torch.bfloat16, None) == (torch.bfloat16 if bf16 and not kernel_runs else torch.float32)
    assert lm_mod.resolve_dtype("bfloat16", cpu, torch.float32, 2**40) == torch.bfloat16
    with pytest.raises(lm_mod.Unsupported, match="float16 on the CPU"):
        lm_mod.resolve_dtype("float16", cpu, None, None)


def test_a_checkpoints_weight_bytes_are_its_weight_files(tmp_path):
    """Its safetensors files where it has them (not a PyTorch copy beside them), else its PyTorch
    weight files, never a trainer's state; None for no weights or no folder."""
    from specdec.lm import weight_bytes

    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 20)
    (tmp_path / "training_args.bin").write_bytes(b"x" * 7)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes(str(tmp_path)) == 20
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 100)
    assert weight_bytes(str(tmp_path)) == 400
    (tmp_path / "empty").mkdir()
    assert weight_bytes(str(tmp_path / "empty")) is None
    assert weight_bytes(str(tmp_path / "missing")) is None and weight_bytes(str(tmp_path / "config.json")) is None
