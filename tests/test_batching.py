"""Batched verification: correctness, isolation between sessions, capacity and idle limits."""
import asyncio
import random
import warnings

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.launch import Service
from client import AsyncClient, Client
from helpers import metric, wait_for
from specdec.lm import LM
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.kvcache import PER_ROW_LEAD, KVCache, forward_packed, use_packed_attention


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def packed(request, model_dir):
    """The tiny target loaded as the services load it (packed attention), in both CPU dtypes."""
    torch.set_num_threads(1)  # the services' setting: GEMM row results are invariant only within one thread
    return LM.load(model_dir("target"), "cpu", request.param)


def cached(model, s, c):
    """A cache of len(s) holding s[:c], put there by a pass of its own."""
    kv = KVCache(len(s))
    if c:
        forward_packed(model, [s[:c]], [kv], logits=False)
    return kv


def test_batched_pass_is_bitwise_equal_to_each_session_alone(packed, model_dir):
    reference = AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=packed.dtype).eval()
    model = packed.model
    r = random.Random(0)
    seqs = [[r.randrange(1, 16) for _ in range(r.randint(2, 40))] for _ in range(7)]
    cut = [r.randint(0, len(s) - 1) for s in seqs]  # cached prefix lengths, 0 included

    batch = [cached(model, s, c) for s, c in zip(seqs, cut)]
    news = [s[c:] for s, c in zip(seqs, cut)]
    logits = forward_packed(model, news, batch)
    for s, c, new, kv, lg in zip(seqs, cut, news, batch, logits):
        alone_kv = cached(model, s, c)
        (alone,) = forward_packed(model, [new], [alone_kv])
        assert torch.equal(alone, lg)  # bitwise: the batch does not change a session's numbers
        assert kv.length == len(s) and all(torch.equal(a[:, : len(s)], b[:, : len(s)]) for a, b in zip(alone_kv.k + alone_kv.v, kv.k + kv.v))
        with torch.no_grad():
            full = reference(torch.tensor([s])).logits[0, c:].float()
        tol = dict(atol=1e-5, rtol=1e-4) if packed.dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
        torch.testing.assert_close(lg, full, **tol)


def test_caches_are_written_in_place_and_sessions_never_copy_each_other(packed):
    """A session's buffers are allocated once, at its first pass, and stay put while others join,
    share passes, leave, and while it is cropped and extended."""
    model = packed.model
    a = KVCache(30)
    forward_packed(model, [[3, 4, 5, 6]], [a], logits=False)
    ptrs = [t.data_ptr() for t in a.k + a.v]
    before = [t[:, :4].clone() for t in a.k]
    b, c = KVCache(20), KVCache(20)
    forward_packed(model, [[7, 8], [9, 10, 11], [12]], [a, b, c])
    b.release()
    a.crop(5)  # a rejection: only the length moves
    forward_packed(model, [[13, 14], [15]], [a, c])
    assert [t.data_ptr() for t in a.k + a.v] == ptrs and a.length == 7
    assert all(torch.equal(t[:, :4], x) for t, x in zip(a.k, before))  # earlier entries untouched
    with pytest.raises(ValueError, match="cache overflow"):
        forward_packed(model, [[1] * 30], [a])
    assert a.length == 7  # a failed pass commits nothing


def test_a_pass_hands_transformers_its_cache_under_the_current_name(packed):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns on
    every call and goes in 5.40): a pass, with logits or keys and values only, uses whichever name
    the installed version's forward takes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        forward_packed(packed.model, [[3, 4, 5]], [KVCache(3)])  # the CausalLM's forward
        forward_packed(packed.model, [[3, 4, 5]], [KVCache(3)], logits=False)  # the base model's


REQS = [dict(prompt_ids=[3 + i % 5, 4, 5 + i % 3], max_new_tokens=20 + 3 * i, temperature=[0.0, 1.0, 0.7][i % 3], top_k=[0, 0, 6][i % 3],
             seed=100 + i, num_draft_tokens=1 + i % 5, proposal_mode=["sparse", "dense", "greedy"][i % 3]) for i in range(12)]


def test_same_seed_same_tokens_alone_or_under_load(services):
    v, d = services("target", "draft")
    with Client(d.address, timeout=120) as c:
        alone = [c.generate(**r).token_ids for r in REQS]
    def shared(svc, name):  # passes so far, and passes that had one session only
        text = svc.metrics()
        return metric(text, f"{name}_count"), metric(text, f"{name}_bucket", le="1.0")

    before = shared(v, "specdec_verify_batch_size"), shared(d, "specdec_draft_batch_size")

    async def together():
        async with AsyncClient(d.address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(**r) for r in REQS))

    loaded = [r.token_ids for r in asyncio.run(together())]
    assert loaded == alone
    after = shared(v, "specdec_verify_batch_size"), shared(d, "specdec_draft_batch_size")
    for (n0, single0), (n1, single1), what in zip(before, after, ["verify", "draft"]):
        assert (n1 - n0) - (single1 - single0) >= 3, f"sessions must actually have shared {what} passes"


def test_long_prompt_is_prefilled_in_chunks_and_stays_exact(services, model_dir):
    _, d = services("long-target", "long-draft")
    target = AutoModelForCausalLM.from_pretrained(model_dir("long-target"), dtype=torch.float32).eval()
    r = random.Random(1)
    prompt = [r.randrange(1, 16) for _ in range(700)]  # > 2 prefill chunks
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=1)[0, 700:].tolist()
    with Client(d.address, timeout=120) as c:
        assert c.generate(prompt_ids=prompt, max_new_tokens=12, num_draft_tokens=3).token_ids == ref


def _start(fp, prompt=(3, 4), max_new=8):
    return pb.VerifyRequest(start=pb.SessionStart(prompt_ids=list(prompt), max_new_tokens=max_new, vocab_fingerprint=fp))


async def _open_session(stub, fp, **kw):
    call = stub.Session()
    await call.write(_start(fp, **kw))
    await call.write(pb.VerifyRequest(round=pb.Round(round=1, tokens=[])))
    return call, await call.read()


async def _refused_session(stub, fp, **kw) -> grpc.aio.AioRpcError:
    """Opens a session the verifier must refuse at `start`: writes only the start and reads the
    status (a second write could race the refusal and lose its status, grpc/grpc#36066)."""
    call = stub.Session()
    await call.write(_start(fp, **kw))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(call.read(), 60)
    return e.value


def test_capacity_limits_answer_resource_exhausted_and_recover(model_dir):
    v = Service("verify_service", "--model", model_dir("target"), "--max-sessions", "2", "--max-cached-tokens", "40", "--metrics-port", "0")
    try:
        async def run():
            async with grpc.aio.insecure_channel(v.address) as ch:
                stub = pb_grpc.VerifyStub(ch)
                fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
                a, ra = await _open_session(stub, fp)
                b, rb = await _open_session(stub, fp)
                assert ra.round == 1 and rb.round == 1
                e = await _refused_session(stub, fp)  # third session: over --max-sessions
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.details()
                assert dict(e.trailing_metadata()).get("retry-after-ms")
                a.cancel()
                b.cancel()
                for _ in range(100):  # the server frees cancelled sessions promptly; wait for it under load
                    if metric(v.metrics(), "specdec_live_sessions", service="verify") == 0:
                        break
                    await asyncio.sleep(0.05)
                e = await _refused_session(stub, fp, max_new=60)  # 2 + 60 tokens > --max-cached-tokens 40
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cache" in e.details()
                c, rc = await _open_session(stub, fp)  # room again
                assert rc.round == 1
                c.cancel()
        asyncio.run(run())
        wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
        text = v.metrics()
        assert metric(text, "specdec_capacity_rejections_total", reason="sessions") == 1
        assert metric(text, "specdec_capacity_rejections_total", reason="cached_tokens") == 1
        assert metric(text, "specdec_live_sessions", service="verify") == 0
    finally:
        v.stop()


def test_idle_session_times_out_and_frees_its_cache(model_dir):
    v = Service("verify_service", "--model", model_dir("target"), "--idle-timeout-s", "1", "--metrics-port", "0")
    try:
        async def run():
            async with grpc.aio.insecure_channel(v.address) as ch:
                stub = pb_grpc.VerifyStub(ch)
                fp = (await stub.Info(pb.InfoRequest())).vocab_fingerprint
                call, _ = await _open_session(stub, fp)
                assert metric(v.metrics(), "specdec_cached_tokens") > 0
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()  # we send nothing more
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in e.value.details()
        asyncio.run(run())
        # the status reaches the client before the handler's cleanup has run: give it a moment
        assert wait_for(lambda: metric(v.metrics(), "specdec_live_sessions", service="verify") == 0, 5)
        assert metric(v.metrics(), "specdec_cached_tokens") == 0
    finally:
        v.stop()


def test_cache_budget_is_sized_from_the_model_and_memory(packed):
    from specdec.kvcache import attention_dtype
    from verify_service.capacity import default_cache_budget, kv_bytes_per_token

    kv = KVCache(5)
    forward_packed(packed.model, [[3, 4, 5, 6, 7]], [kv], logits=False)
    dt = attention_dtype(packed.model)  # the model's, or float32 for a half-precision model where this CPU attends faster so
    assert dt in (packed.dtype, torch.float32)
    assert kv.k[0].dtype == dt and kv_bytes_per_token(packed.model.config, dt) == kv.nbytes() / 5  # the real dtype's size
    budget = default_cache_budget(packed, max_sessions=8)
    assert packed.max_context <= budget <= 8 * packed.max_context


def _run_batch(eng, spec):
    """Runs the rounds [(session, proposals, q)] as ONE scheduler pass (no queue, so the batch is
    exactly this), returning each session's Verdict or exception."""
    from verify_service.scheduler import _Job

    loop = asyncio.new_event_loop()
    try:
        jobs = [_Job(s, loop.create_future(), loop, toks, q) for s, toks, q in spec]
        eng._run(jobs, None)
        return loop.run_until_complete(asyncio.gather(*(j.future for j in jobs), return_exceptions=True))
    finally:
        loop.close()


def _prefilled(eng, prompts, sampling=None):
    from specdec.sampling import Sampling
    from verify_service.scheduler import _Job

    out = []
    for p in prompts:
        s = eng.open(p, 8, sampling or Sampling(), seed=3, mode=pb.PROPOSAL_MODE_GREEDY)
        loop = asyncio.new_event_loop()
        try:
            job = _Job(s, loop.create_future(), loop)
            eng._run([], job)
            loop.run_until_complete(job.future)
        finally:
            loop.close()
        out.append(s)
    return out


@pytest.mark.parametrize("where", ["pass", "acceptance"])
def test_a_failing_session_fails_alone_and_its_batch_mates_get_their_solo_verdicts(packed, where):
    """One session of a batched pass raises, in the forward pass (its cache cannot take the round)
    or in the acceptance rule (a q of the wrong shape): that session gets the error, the others
    get exactly the verdicts they get alone."""
    from specdec.sampling import Sampling
    from verify_service.scheduler import Scheduler

    prompts = [[3, 4, 5, 6], [7, 8, 9], [4, 4, 5, 9, 10]]
    rounds = [[5, 6, 7], [8, 9], [6, 6, 6, 6]]
    eng = Scheduler(packed, max_sessions=8)
    try:
        solo = [_run_batch(eng, [(s, r, None)])[0] for s, r in zip(_prefilled(eng, prompts), rounds)]
        assert all(not isinstance(v, Exception) for v in solo), solo
        if where == "pass":
            ss = _prefilled(eng, prompts)
            ss[1].cache = KVCache(1)  # room for one token: its round's writes fail inside the pass
            spec = [(s, r, None) for s, r in zip(ss, rounds)]
        else:
            ss = _prefilled(eng, prompts[:1]) + _prefilled(eng, prompts[1:2], Sampling(temperature=1.0)) + _prefilled(eng, prompts[2:])
            bad_q = torch.full((len(rounds[1]), 3), 1 / 3)  # 3 columns for a vocabulary of 16
            spec = [(s, r, bad_q if i == 1 else None) for i, (s, r) in enumerate(zip(ss, rounds))]
        got = _run_batch(eng, spec)
        assert isinstance(got[1], Exception), got
        for v, w in ((got[0], solo[0]), (got[2], solo[2])):
            assert not isinstance(v, Exception), got
            assert (v.num_accepted, v.next_token, v.finish) == (w.num_accepted, w.next_token, w.finish)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A random Llama as wide as the shipped target's MLP (1408): one-row bf16 matmuls of this
    width take a kernel whose sums round differently from two rows up."""
    from bench import tinymodels

    return tinymodels.build(str(tmp_path_factory.mktemp("wide")), vocab_size=512, hidden=704, layers=2, heads=8,
                            max_context=256, seed=5)


def load_packed(path: str, dtype: str, matmuls: str) -> LM:
    """The model as the services load it ("calibrated": GEMMs, or per-row products where the
    calibration says they pay), with per-row matmul products forced ("per-row"), or in half
    precision with prepacked GEMMs forced where oneDNN has bf16 ("prepacked") or with the module's
    own GEMMs ("unpacked")."""
    if matmuls == "calibrated":
        return LM.load(path, "cpu", dtype)
    lm = LM.load(path, "cpu", dtype, check=False)
    if matmuls in ("prepacked", "unpacked"):
        use_packed_attention(lm.model, prepack=matmuls == "prepacked")
        assert getattr(lm.model, "_specdec_prepacked", False) == (matmuls == "prepacked" and BF16_ONEDNN)
        return lm
    use_packed_attention(lm.model, per_row=True)
    assert lm.model._specdec_rows[0] == 1 and lm.model._specdec_lead == PER_ROW_LEAD  # kept: no padding rows
    return lm


# per-row products forced in float32 only: bf16 keeps its GEMMs on CPUs with bf16 instructions
# (per-row bf16 products were 10x slower there), and forcing them costs minutes of test time.
# bf16 runs both with its GEMMs prepacked and with the plain ones (the services prepack where it pays).
MATMULS = [("float32", "calibrated"), ("bfloat16", "prepacked"), ("float32", "per-row"), ("bfloat16", "unpacked")]
BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype,matmuls", MATMULS)
def test_one_token_steps_and_rounds_give_bitwise_equal_logits(wide_dir, dtype, matmuls):
    """A position's logits are the same computed in a one-token step or inside a round of tau+1
    tokens, so greedy speculative output is the service's own target-only output bitwise."""
    torch.set_num_threads(1)
    lm = load_packed(wide_dir, dtype, matmuls)
    steps, rounds, _ = steps_and_rounds(lm.model, torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(0)).tolist())
    assert torch.equal(steps, rounds), float((steps - rounds).abs().max())


def steps_and_rounds(model, ids: list[int]):
    """The logits of ids' second half after its first half in the cache: one token a pass, and
    five tokens a pass (rounds of tau = 4); and the stepped cache."""
    half = len(ids) // 2
    a, b = KVCache(len(ids)), KVCache(len(ids))
    forward_packed(model, [ids[:half]], [a], logits=False)
    forward_packed(model, [ids[:half]], [b], logits=False)
    steps = torch.cat([forward_packed(model, [[t]], [a])[0] for t in ids[half:]])
    rounds = torch.cat([forward_packed(model, [ids[i:i + 5]], [b])[0] for i in range(half, len(ids), 5)])
    return steps, rounds, a


@pytest.mark.parametrize("dtype,matmuls", MATMULS)
@pytest.mark.parametrize("prefill", [False, True], ids=["chunk-with-logits", "prefill-chunk"])
def test_batch_invariance_holds_at_real_widths(dtype, prefill, matmuls, tmp_path):
    """At the shipped target's widths, CPU GEMM kernels change with the row count (float32 here:
    1, 2-15 and 16+ rows are three classes), so a pass is padded to the calibrated lo rows and each
    matmul cuts longer inputs into blocks of lo..hi rows: a session's numbers stay its own in a
    pass of a few hundred rows, a 90-token chunk among them. As a prefill chunk (no logits)
    that chunk goes first, in one product of its own: its keys and values are those of the chunk
    prefilled alone, and its batch-mates' numbers are unchanged by it. With per-row products
    nothing is padded, and the prefill chunk still has a GEMM of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tinymodels import word_tokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    word_tokenizer(8192).save_pretrained(tmp_path)
    lm = load_packed(str(tmp_path), dtype, matmuls)
    lo, hi = lm.model._specdec_rows
    assert 1 <= lo <= 8 and hi >= 2 * lo
    model = lm.model
    r = random.Random(1)
    n = 60  # sessions in rounds: enough rows for several blocks wherever the CPU's classes end (hi <= ROW_PROBE)
    seqs = [[r.randrange(3, 8192) for _ in range(r.randint(8, 60))] for _ in range(n)] + [[r.randrange(3, 8192) for _ in range(100)]]
    cut = [len(s) - r.randint(1, 5) for s in seqs[:-1]] + [10]  # rounds of 1-5 tokens, and a 90-token chunk, last as the scheduler puts it
    want = [True] * n + [not prefill]

    batch = [cached(model, s, c) for s, c in zip(seqs, cut)]
    news = [s[c:] for s, c in zip(seqs, cut)]
    assert sum(map(len, news[:-1])) > 2 * hi and len(news[-1]) > hi
    logits = forward_packed(model, news, batch, want)
    assert (logits[-1] is None) == prefill
    for s, c, new, kv, lg, w in zip(seqs, cut, news, batch, logits, want):
        alone_kv = cached(model, s, c)
        (alone,) = forward_packed(model, [new], [alone_kv], w)
        assert (alone is None and lg is None) or torch.equal(alone, lg)
        assert all(torch.equal(a[:, : len(s)], b[:, : len(s)]) for a, b in zip(alone_kv.k + alone_kv.v, kv.k + kv.v))


def test_row_calibration_finds_where_a_kernel_changes():
    """calibrate_rows' search, on a matmul whose results change at 1 row and from 10 rows on."""
    from specdec.kvcache import _class_top

    def fwd(x):  # [1, k, 16], row by row (no real GEMM, whose kernels vary too): nudged at 1 row and from 10 rows on
        k = x.shape[1]
        return x[..., :8] * 3.0 + (1e-3 if k >= 10 or k == 1 else 0.0)

    x = torch.randn(65, 16)
    assert _class_top(fwd, x, 1) == 1
    assert _class_top(fwd, x, 2) == 9
    assert _class_top(lambda x: x[..., :8] * 3.0, x, 2) == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_products_give_a_row_the_same_numbers_at_any_row_count(dtype):
    """A per-row product (one row per batch entry) is the module's own product up to rounding,
    and gives each row bitwise the same numbers whatever the row count and wherever it sits."""
    from transformers.pytorch_utils import Conv1D

    from specdec.kvcache import _per_row

    torch.manual_seed(0)
    x = torch.randn(1, 40, 96).to(dtype)
    for m in (torch.nn.Linear(96, 200), torch.nn.Linear(96, 200, bias=False), Conv1D(200, 96)):
        m = m.to(dtype)
        fwd = _per_row(m)
        full = fwd(x)
        torch.testing.assert_close(full, m(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        for k in (1, 2, 3, 5, 17):
            for at in (0, 7, 40 - k):
                assert torch.equal(fwd(x[:, at : at + k]), full[:, at : at + k])


def test_per_row_products_keep_one_copy_of_each_weight(wide_dir):
    """Switching to per-row products transposes each weight once and keeps only that copy (the
    original is freed; a weight tied to the embeddings stays, and its transposed copy is the one
    extra), and the model's own forward still gives its logits."""
    import gc
    import weakref

    torch.set_num_threads(1)
    lm = LM.load(wide_dir, "cpu", "float32", check=False)
    model = lm.model
    ids = torch.tensor([[5, 9, 13, 40, 7]])
    with torch.inference_mode():
        want = model(ids).logits
    embedding = model.get_input_embeddings().weight
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    originals = [(weakref.ref(m.weight), m.weight is embedding) for m in linears]
    use_packed_attention(model, per_row=True)
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

    from specdec.kvcache import _prepacked

    torch.manual_seed(0)
    x = torch.randn(1, 40, 96).to(torch.bfloat16)
    conv = Conv1D(200, 96)
    torch.nn.init.normal_(conv.bias)  # zeros by default: a dropped bias would pass unseen
    with torch.inference_mode():
        for m in (torch.nn.Linear(96, 200), torch.nn.Linear(96, 200, bias=False), conv):
            m = m.to(torch.bfloat16)
            fwd = _prepacked(m)
            for k in (1, 2, 3, 5, 17, 40):
                assert torch.equal(fwd(x[:, :k]), m(x[:, :k])), (type(m).__name__, k)


def _logits_of_a_session(model) -> torch.Tensor:
    c = KVCache(48)
    outs = [forward_packed(model, [[3 + i % 13 for i in range(30)]], [c])[0], forward_packed(model, [[7, 8, 9, 10, 11]], [c])[0],
            forward_packed(model, [[12]], [c])[0]]
    return torch.cat(outs)


PINS = [("float32", "per-row=on"), ("float32", "per-row=off"), ("bfloat16", "attention=model,prepack=off,per-row=off"),
        pytest.param("bfloat16", "attention=float32,prepack=on,per-row=off",
                     marks=pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU"))]


@pytest.mark.parametrize("dtype,pin", PINS)
def test_pinned_engine_choices_are_made_as_given_without_timing(model_dir, monkeypatch, dtype, pin):
    """--engine-choices: each pinned choice is made as given (where its checks pass, as they do
    here), with no timing at all; two loads with the same pins compute bitwise the same logits."""
    from specdec import kvcache
    from specdec.kvcache import engine_choices, parse_choices

    def clock(*a, **kw):
        raise AssertionError("a pinned choice was timed")

    monkeypatch.setattr(kvcache, "_best_seconds", clock)
    torch.set_num_threads(1)
    lms = [LM.load(model_dir("target"), "cpu", dtype, choices=parse_choices(pin)) for _ in range(2)]
    assert [engine_choices(lm.model) for lm in lms] == [pin, pin]
    assert torch.equal(_logits_of_a_session(lms[0].model), _logits_of_a_session(lms[1].model))


INF = float("inf")
OUTCOMES = [  # dtype, attention timed faster in float32, prepack gain needed, per-row products timed to pay, GEMMs calibrate
    ("float32", None, None, True, True), ("float32", None, None, False, True), ("float32", None, None, True, False),
    ("bfloat16", True, 0.0, False, True), ("bfloat16", False, INF, True, True), ("bfloat16", False, INF, False, True),
    ("bfloat16", True, 0.0, True, False),  # prepacking kept, then undone: no GEMM row counts agree
]


@pytest.mark.parametrize("dtype,fp32_attention,gain,pays,gemms", OUTCOMES)
def test_a_timed_loads_choices_pinned_give_its_numbers(model_dir, monkeypatch, dtype, fp32_attention, gain, pays, gemms):
    """Whatever the timings decide (forced here, one outcome each), the choices a load logs, pinned
    at the next load, are made again without timing and give bitwise the same logits."""
    from specdec import kvcache
    from specdec.kvcache import engine_choices, parse_choices

    if fp32_attention is not None:
        monkeypatch.setattr(kvcache, "_faster_attention", lambda model: torch.float32 if fp32_attention else model.dtype)
    if gain is not None:
        monkeypatch.setattr(kvcache, "PREPACK_GAIN", gain)
    monkeypatch.setattr(kvcache, "_per_row_pays", lambda model, lo, per_row: pays)
    if not gemms:
        real = kvcache.calibrate_rows
        monkeypatch.setattr(kvcache, "calibrate_rows", lambda model, seeds=2, **kw: real(model, seeds, **kw) if kw else None)
    torch.set_num_threads(1)
    timed = LM.load(model_dir("target"), "cpu", dtype)
    chosen = engine_choices(timed.model)
    if dtype == "bfloat16":
        assert chosen.startswith(f"attention={'float32' if fp32_attention else 'model'},")
        if BF16_ONEDNN:
            assert ("prepack=on" in chosen) == (gain == 0.0 and gemms), chosen  # kept, or undone where no GEMM rows agree

    def clock(*a, **kw):
        raise AssertionError("a pinned choice was timed")

    monkeypatch.setattr(kvcache, "_best_seconds", clock)
    pinned = LM.load(model_dir("target"), "cpu", dtype, choices=parse_choices(chosen))
    assert engine_choices(pinned.model) == chosen
    assert pinned.model._specdec_rows == timed.model._specdec_rows
    assert torch.equal(_logits_of_a_session(pinned.model), _logits_of_a_session(timed.model))


def test_engine_choices_parse_and_refuse():
    from specdec.kvcache import parse_choices

    assert parse_choices("") == {} and parse_choices(None) == {}
    assert parse_choices(" attention=float32 , prepack=off,per-row=on") == {"attention": "float32", "prepack": False, "per_row": True}
    for bad in ("prepack", "prepack=yes", "attention=bfloat16", "rows=4", "per-row=on,per-row=off", "prepack=on,per-row=on"):
        with pytest.raises(ValueError, match="--engine-choices"):
            parse_choices(bad)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
@pytest.mark.parametrize("timings,kept", [([1.0, 2.0, 2.0, 2.0], True), ([1.0] * 6, False)])
def test_a_prepacking_that_misses_the_bar_is_timed_again(tied_dir, monkeypatch, timings, kept):
    """One slow timing (a loaded machine) does not drop the prepacking: up to PREPACK_TRIES tries
    of (step, round) gains, kept at the first that clears PREPACK_GAIN."""
    from specdec import kvcache

    gains = iter(timings)
    tries = []
    monkeypatch.setattr(kvcache, "_matmul_seconds", lambda model, runs: tries.append(1) or [next(gains), 1.0])
    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False).model
    assert (kvcache._prepack(model) is not None) == kept
    assert len(tries) == (4 if kept else 2 * kvcache.PREPACK_TRIES)  # a step and a round per try: bad, then good


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
def test_modules_that_share_a_weight_share_its_packed_copy(monkeypatch):
    """Two Linear modules holding one weight (each with a bias of its own) get one packed copy of
    it between them, counted once against the memory share; a module with a weight of its own gets
    its own. Each module keeps its own bias."""
    from specdec import kvcache

    class Shared(torch.nn.Module):
        dtype = torch.bfloat16

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(64, 96) for _ in range(3))
            self.b.weight = self.a.weight

    torch.manual_seed(0)
    model = Shared().to(torch.bfloat16)
    made = []
    monkeypatch.setattr(kvcache, "_packed_weight", lambda m, real=kvcache._packed_weight: made.append(m) or real(m))
    # two distinct bf16 weights take 24,576 bytes and fit in a quarter of 120,000; three (36,864) would not
    monkeypatch.setattr(kvcache, "available_memory_bytes", lambda device=None: 120_000)
    former = kvcache._prepack(model, force=True)
    assert former is not None and set(former) == {model.a, model.b, model.c}
    assert len(made) == 2 and {model.a, model.b} & set(made) and model.c in made
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        for m in (model.a, model.b, model.c):
            assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A small random Llama whose output layer is tied to its input embeddings, as the shipped pair's are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tinymodels import word_tokenizer

    path = tmp_path_factory.mktemp("tied")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    word_tokenizer(512).save_pretrained(path)
    return str(path)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 kernels on this CPU: the engine keeps its GEMMs")
def test_prepacked_matmuls_keep_the_models_numbers_and_its_weights(tied_dir, monkeypatch):
    """bf16 on the CPU: after prepacking, the model's own forward gives bitwise the logits it gave
    before, and its plain weights are all still there (whatever reads one directly gets the right
    numbers). Where the packed copies would not fit in a quarter of the free memory, nothing is packed."""
    from specdec import kvcache

    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False).model
    ids = torch.tensor([[5, 9, 13, 40, 7]])
    with torch.inference_mode():
        want = model(ids).logits
    weights = {n: p.clone() for n, p in model.named_parameters()}
    use_packed_attention(model, prepack=True)
    assert model._specdec_prepacked
    assert {n: p for n, p in model.named_parameters()}.keys() == weights.keys()
    assert all(p.device.type == "cpu" and torch.equal(p, weights[n]) for n, p in model.named_parameters())
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)

    monkeypatch.setattr(kvcache, "available_memory_bytes", lambda device=None: 1 << 20)  # 1 MiB free
    small = LM.load(tied_dir, "cpu", "bfloat16", check=False).model
    use_packed_attention(small, prepack=True)
    assert not getattr(small, "_specdec_prepacked", False)


def test_prepacking_is_undone_where_no_row_counts_agree(tied_dir, monkeypatch):
    """If the prepacked GEMMs calibrate to no row counts, the modules go back to their plain
    forwards, so per-row products can be tried."""
    from specdec import kvcache

    real = kvcache.calibrate_rows
    monkeypatch.setattr(kvcache, "calibrate_rows", lambda model, seeds=2, **kw: real(model, seeds, **kw) if kw else None)
    torch.set_num_threads(1)
    model = LM.load(tied_dir, "cpu", "bfloat16", check=False).model
    use_packed_attention(model, prepack=True)
    assert not getattr(model, "_specdec_prepacked", False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model._specdec_rows is None:  # per-row products did not calibrate either: the plain modules serve
        assert all(m.forward.__func__ is type(m).forward for m in linears)
    else:  # per-row products were kept
        assert model._specdec_rows[0] == 1


@pytest.mark.parametrize("n_prompt", [5, 40])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_only_stream_takes_its_first_step_in_its_prompts_last_pass(packed, n_prompt, temperature, monkeypatch):
    """Target-only, the first step runs in the pass of the prompt's last chunk, as a second input
    of the same session: one pass fewer than a prefill and then steps, and bitwise the same tokens."""
    import verify_service.scheduler as scheduler
    from specdec.sampling import Sampling

    passes = []

    def counted(*a, **kw):
        passes.append(1)
        return forward_packed(*a, **kw)

    monkeypatch.setattr(scheduler, "forward_packed", counted)
    r = random.Random(n_prompt)
    prompt = [r.randrange(3, 16) for _ in range(n_prompt)]
    eng = scheduler.Scheduler(packed, max_sessions=4)
    passes.clear()  # the pass-cost probe's, at start-up

    async def stepped():  # the Session path: the prefill awaited, then one round per token
        s = eng.open(prompt, 12, Sampling(temperature=temperature), seed=9, mode=pb.PROPOSAL_MODE_GREEDY)
        await eng.prefill(s)
        while not s.finish:
            await eng.step(s, [], None)
        eng.close(s)
        return s.ids

    async def streamed():
        s = eng.open(prompt, 12, Sampling(temperature=temperature), seed=9, mode=pb.PROPOSAL_MODE_GREEDY)
        got = [v.next_token async for v in eng.steps(s)]
        eng.close(s)
        assert s.prefill_s > 0 and got == s.ids[n_prompt:]
        return s.ids

    try:
        a = asyncio.run(stepped())
        n_stepped, passes[:] = len(passes), []
        b = asyncio.run(streamed())
    finally:
        eng.shutdown()
    assert a == b and n_prompt < len(a) <= n_prompt + 12  # EOS may end it early
    assert len(passes) == n_stepped - 1 == len(a) - n_prompt  # a pass per token, the prompt's included


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_target_only_stream_beside_rounds_gives_its_solo_tokens(model_dir, dtype, monkeypatch):
    """A stream whose prompt takes three prefill chunks, the last longer than the calibrated block
    (so in a product of its own, merged with its first step), shares passes with another session's
    rounds: both get bitwise the tokens they get alone."""
    import verify_service.scheduler as scheduler
    from specdec.kvcache import PREFILL_CHUNK
    from specdec.sampling import Sampling

    passes = []  # per pass: the number of inputs and of distinct caches

    def recorded(model, inputs, caches, logits=True):
        passes.append((len(inputs), len({id(c) for c in caches})))
        return forward_packed(model, inputs, caches, logits)

    monkeypatch.setattr(scheduler, "forward_packed", recorded)
    torch.set_num_threads(1)
    lm = LM.load(model_dir("long-target"), "cpu", dtype)
    r = random.Random(3)
    long_prompt = [r.randrange(3, 16) for _ in range(2 * PREFILL_CHUNK + 104)]
    assert len(long_prompt) - 1 - 2 * PREFILL_CHUNK > lm.model._specdec_rows[1]  # the last chunk has a product of its own
    short_prompt = [r.randrange(3, 16) for _ in range(20)]
    eng = scheduler.Scheduler(lm, max_sessions=4)

    async def stream(after: asyncio.Event | None = None):
        if after is not None:
            await after.wait()
        s = eng.open(long_prompt, 16, Sampling(temperature=0.0), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            return [v.next_token async for v in eng.steps(s)]
        finally:
            eng.close(s)

    async def rounds(started: asyncio.Event | None = None):  # proposals of three tokens each (the verdicts decide)
        s = eng.open(short_prompt, 40, Sampling(temperature=0.0), seed=2, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            await eng.prefill(s)
            while not s.finish:
                if started is not None:
                    started.set()  # the stream's prompt goes in while this session runs rounds
                await eng.step(s, [s.ids[-1]] * 3, None)
            return s.ids[len(short_prompt):]
        finally:
            eng.close(s)

    async def both():
        started = asyncio.Event()
        return await asyncio.gather(stream(started), rounds(started))

    try:
        solo = (asyncio.run(stream()), asyncio.run(rounds()))
        assert len(solo[0]) == 16 and len(solo[1]) == 40
        passes.clear()
        for _ in range(3):  # bounded: until a round has shared the merged pass (timing: the round must be back in the queue)
            assert tuple(asyncio.run(both())) == solo
            if (3, 2) in passes:  # a round, the stream's last chunk and its first step in one pass
                break
    finally:
        eng.shutdown()
    assert (3, 2) in passes, passes


@pytest.mark.parametrize("gain,expect", [(0.0, torch.float32), (1e9, torch.bfloat16)], ids=["float32-attention", "bf16-attention"])
def test_a_half_precision_model_attends_in_the_dtype_chosen_at_load(wide_dir, gain, expect, monkeypatch):
    """On the CPU a bf16 model keeps its cache and attends in float32 where that is ATTN_FLOAT32_GAIN
    times faster (measured at load), else in bf16 (the gain forces either here). Either way a
    position's logits are bitwise the same in a one-token step and inside a round."""
    import specdec.kvcache as kvcache

    monkeypatch.setattr(kvcache, "ATTN_FLOAT32_GAIN", gain)
    torch.set_num_threads(1)
    lm = LM.load(wide_dir, "cpu", "bfloat16")
    assert kvcache.attention_dtype(lm.model) == expect
    steps, rounds, cache = steps_and_rounds(lm.model, torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(1)).tolist())
    assert cache.k[0].dtype == expect
    assert torch.equal(steps, rounds), float((steps - rounds).abs().max())
