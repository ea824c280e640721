"""Measures, before any design: would torch's varlen (FlashAttention) attention pay in the verify
pass on a GPU, against the engine's own layout? One layer of the Llama-3-8B shape (32 query heads,
8 KV heads, 128 dims, bf16) for B sessions of `--context` cached keys each, n new query rows each.

    python -m bench.varlen_probe --out DIR [--sessions 1,8,64 --rows 1,5 --context 384]

Variants, each timed as a CUDA graph of --layers calls replayed (so launch costs count as they do
in the engine's captured passes), falling back to eager calls where a variant cannot be captured:
  engine   the engine's GPU layout (layout.py, attention.py): each session's keys gathered from the
           paged pool into [B, H_kv, Lb, D], a session's queries and GQA heads as one problem's
           rows, a boolean mask, one SDPA call;
  varlen   torch.nn.attention.varlen.varlen_attn over the same keys gathered packed (exactly each
           session's length), causal;
  paged    varlen_attn reading the pool's pages in place through a block table, where this
           torch's varlen_attn takes one (no gather at all).
Each variant's output is compared with a float32 reference of the engine's mask. On the CPU only
the engine variant runs (a shape check of this script). Writes varlen_probe.json and prints a table.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import time

import torch

from specdec.engine.cache import PAGE

H, HKV, D = 32, 8, 128


def setup(B: int, n: int, L: int, dev, dtype, gen: torch.Generator) -> dict:
    """A paged pool with each session's pages scattered, and every index each variant needs."""
    pages_each = -(-L // PAGE)
    pages = torch.randperm(B * pages_each, generator=gen).view(B, pages_each) + 1  # page 0: trash
    slots_total = (B * pages_each + 1) * PAGE
    K = torch.randn(slots_total, HKV, D, generator=gen).to(dev, dtype)
    V = torch.randn(slots_total, HKV, D, generator=gen).to(dev, dtype)
    q = torch.randn(B * n, H, D, generator=gen).to(dev, dtype)
    Lb = pages_each * PAGE
    pos = torch.arange(Lb)
    slot = (pages[:, pos // PAGE] * PAGE + pos % PAGE)  # [B, Lb]
    slot = torch.where(pos[None] < L, slot, torch.zeros_like(slot))  # past the length: the trash page
    qpos = torch.arange(L - n, L)[None].expand(B, n)
    mask = (pos[None, None, :] <= qpos[:, :, None])  # [B, n, Lb]
    rep = H // HKV
    emask = mask[:, None, :, None, :].expand(B, 1, n, rep, Lb).reshape(B, 1, n * rep, Lb)
    packed = slot[:, :L].reshape(-1)  # exactly each session's keys, packed
    return dict(B=B, n=n, L=L, Lb=Lb, K=K, V=V, q=q, gather=slot.reshape(-1).to(dev), emask=emask.to(dev),
                packed=packed.to(dev), mask=mask.to(dev),
                cu_q=torch.arange(0, B * n + 1, n, dtype=torch.int32, device=dev),
                cu_k=torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev),
                table=pages.to(torch.int32).to(dev), used=torch.full((B,), L, dtype=torch.int32, device=dev))


def engine(c: dict) -> torch.Tensor:
    B, n, Lb = c["B"], c["n"], c["Lb"]
    rep = H // HKV
    k = c["K"].index_select(0, c["gather"]).view(B, Lb, HKV, D).transpose(1, 2)
    v = c["V"].index_select(0, c["gather"]).view(B, Lb, HKV, D).transpose(1, 2)
    q = c["q"].view(B, n, HKV, rep, D).transpose(1, 2).reshape(B, HKV, n * rep, D)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=c["emask"])
    return o.view(B, HKV, n, rep, D).transpose(1, 2).reshape(B * n, H, D)


def _varlen_kwargs(params) -> dict:
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned to each sequence's last key
    elif "is_causal" in params:
        kw["is_causal"] = True
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


@functools.cache
def _varlen_api():
    """torch's varlen_attn and its parameters, looked up once (eager CPU timings would count it)."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn, inspect.signature(varlen_attn).parameters


def varlen(c: dict) -> torch.Tensor:
    varlen_attn, params = _varlen_api()
    kw = _varlen_kwargs(params)
    k, v = c["K"].index_select(0, c["packed"]), c["V"].index_select(0, c["packed"])
    return varlen_attn(c["q"], k, v, c["cu_q"], c["cu_k"], c["n"], c["L"], **kw)


def paged(c: dict) -> torch.Tensor:
    varlen_attn, params = _varlen_api()
    if "block_table" not in params:
        raise NotImplementedError("this torch's varlen_attn takes no block_table")
    kw = _varlen_kwargs(params)
    pages = c["K"].shape[0] // PAGE
    return varlen_attn(c["q"], c["K"].view(pages, PAGE, HKV, D), c["V"].view(pages, PAGE, HKV, D), c["cu_q"], None,
                       c["n"], c["L"], seqused_k=c["used"], block_table=c["table"], **kw)


def reference(c: dict) -> torch.Tensor:
    B, n, Lb = c["B"], c["n"], c["Lb"]
    rep = H // HKV
    k = c["K"].index_select(0, c["gather"]).float().view(B, Lb, HKV, D).repeat_interleave(rep, dim=2)  # [B, Lb, H, D]
    v = c["V"].index_select(0, c["gather"]).float().view(B, Lb, HKV, D).repeat_interleave(rep, dim=2)
    q = c["q"].float().view(B, n, H, D)
    w = torch.einsum("bnhd,blhd->bhnl", q, k) * D**-0.5
    w = w.masked_fill(~c["mask"][:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhnl,blhd->bnhd", w, v).reshape(B * n, H, D)


def timed_us(fn, c: dict, layers: int, replays: int) -> tuple[float, str]:
    """Microseconds a call: a CUDA graph of `layers` calls replayed, or eager calls where capture fails."""
    if c["q"].device.type != "cuda":
        fn(c)
        t0 = time.perf_counter()
        for _ in range(layers):
            fn(c)
        return (time.perf_counter() - t0) / layers * 1e6, "eager (cpu)"
    for _ in range(3):
        fn(c)
    torch.cuda.synchronize()
    how = "graph"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(c)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(layers):
                fn(c)
        run = g.replay
    except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly and say so
        how = f"eager ({type(e).__name__})"

        def run():
            for _ in range(layers):
                fn(c)
    run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        run()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (replays * layers), how


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,8,64")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    from torch.nn.attention import varlen as vl
    header = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "varlen_attn": str(inspect.signature(vl.varlen_attn)) if hasattr(vl, "varlen_attn") else None}
    print(json.dumps(header))
    rows = []
    for B in map(int, a.sessions.split(",")):
        for n in map(int, a.rows.split(",")):
            c = setup(B, n, a.context, dev, dtype, gen)
            ref = reference(c)
            for name, fn in (("engine", engine), ("varlen", varlen), ("paged", paged)):
                if name != "engine" and not cuda:
                    continue
                r = dict(sessions=B, rows=n, context=a.context, variant=name)
                try:
                    r["max_abs_err"] = float((fn(c).float() - ref).abs().max())
                    r["us"], r["timed_as"] = timed_us(fn, c, a.layers, a.replays)
                except Exception as e:  # noqa: BLE001 - a variant this torch lacks or refuses: say why
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(r)
                print(json.dumps(r), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "varlen_probe.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
