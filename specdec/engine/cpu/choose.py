"""The CPU tier's load-time choices: the dtype a half-precision model attends in, prepacked
weights, per-row products, and the calibrated row counts. Each choice is timed at load (its
contenders in turn, the best of five each) or pinned by --engine-choices; the checks of the
numbers run either way. `choose` returns the engine's Plan."""
from __future__ import annotations

import logging

import torch

from specdec.choices import PIN_KEYWORDS
from specdec.engine.cache import available_memory_bytes
from specdec.engine.cpu import kernel
from specdec.engine.cpu.prepack import PREPACK_MEMORY_SHARE, holders
from specdec.engine.cpu.prepack import prepack as prepack_weights
from specdec.engine.cpu.rows import PER_ROW_LEAD, blocked, clock, calibrate_rows, per_row_pays, row_modules
from specdec.engine.cpu.rows import per_row as per_row_forward
from specdec.engine.plan import Plan

log = logging.getLogger("specdec.engine")

ATTN_FLOAT32_GAIN = 1.5  # a half-precision model attends in float32 on the CPU where that is this much faster
HALF = (torch.bfloat16, torch.float16)
PACKED = (*HALF, torch.float32)  # the dtypes whose weights may be prepacked for oneDNN (prepack.py)


def faster_attention(model, keys: int = 256, timer=None, query: bool = True) -> torch.dtype:
    """For a half-precision model: float32 if one query over `keys` keys, at the model's head shape,
    attends at least ATTN_FLOAT32_GAIN times faster in float32 (the query cast there and the output
    cast back included; through the query attention where it builds and takes these heads, unless
    `query` is False) than in the model's dtype; else the model's dtype. CPU bf16 attention
    kernels differ widely from machine to machine."""
    cfg, dt = model.config.get_text_config(), model.dtype
    try:
        H = cfg.num_attention_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        H_kv = getattr(cfg, "num_key_value_heads", None) or H
    except AttributeError:
        return dt
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h, n in ((H, 1), (H_kv, keys), (H_kv, keys)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qh, kh, vh = q.to(dt), k.to(dt), v.to(dt)  # a cache in the model's dtype, or (k, v) one in float32
    wide = lambda: sdpa(qh.float(), k, v, enable_gqa=H_kv != H).to(dt)  # noqa: E731
    att = kernel.query_attention() if query else None
    if att is not None:  # the float32 cache's own attention: [1, 1, H, D] over [1, keys, H_kv, D]
        kq, vq, seen = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), torch.ones(1, 1, keys, dtype=torch.bool)
        if att(q.transpose(1, 2), kq, vq, seen, D**-0.5) is not None:
            wide = lambda: att(qh.float().transpose(1, 2), kq, vq, seen, D**-0.5).to(dt)  # noqa: E731
    own, wide = (timer or clock)("attention", [lambda: sdpa(qh, kh, vh, enable_gqa=H_kv != H), wide])
    return torch.float32 if own > ATTN_FLOAT32_GAIN * wide else dt


def choose(model, pins: dict | None = None, timer=None) -> Plan:
    """The CPU plan for `model`, its matmul modules switched to it. `pins` (parse_choices' keywords,
    none of them None) pin choices instead of timing them: per_row, prepack (half precision),
    fp32_prepack (float32: another kernel, so its own name, and a pin of either leaves the other
    dtype alone), row_kernel (float32 per-row products through kernel.py's row kernel, used wherever
    it builds unless pinned off), attention_kernel (per-query attention through kernel.py's query
    attention wherever the cache is float32 and it builds, unless pinned off) and attention
    ('float32' or 'model'); timer(what, fns) -> seconds per call of each fn replaces the clock (rows.clock: `what` names the
    choice timed; tests)."""
    name = f"{type(model).__name__} in {model.dtype}"
    pins = pins or {}
    per_row, row_kernel, attention_kernel = pins.get("per_row"), pins.get("row_kernel"), pins.get("attention_kernel")
    plan = _choose(model, per_row, pins.get("fp32_prepack" if model.dtype == torch.float32 else "prepack"), pins.get("attention"),
                   timer, row_kernel, attention_kernel is not False)
    if attention_kernel is not False and plan.kv_dtype == torch.float32:  # not timed: faster at every size measured (one thread)
        plan.query_attention = kernel.query_attention()
    plan.made = _made(model, plan)
    if per_row and row_kernel is None and "row-kernel" in plan.made:
        log.warning("%s: per-row=on pinned without row-kernel; made row-kernel=%s (the two give other numbers: pin it too, "
                    "so that a restart, or a host without a C compiler, makes the same)", name, plan.made["row-kernel"])
    pinned = {PIN_KEYWORDS[k]: pins[k] for k in PIN_KEYWORDS if k in pins}  # in --engine-choices' names and order
    for k, v in pinned.items():
        want = v if k == "attention" else ("on" if v else "off")
        if k not in plan.made:
            log.warning("%s: the pinned %s=%s does not apply to this dtype%s; ignored", name, k, want,
                        {"row-kernel": " or without per-row products", "attention-kernel": " (a cache not in float32)"}.get(k, ""))
        elif plan.made[k] != want:
            log.warning("%s: the pinned %s=%s could not be kept (its check failed, or the kernels are not available here: see above); %s=%s instead",
                        name, k, want, k, plan.made[k])
    log.info("%s: engine choices %s (%s; --engine-choices pins them)", name, plan.choices(),
             f"pinned: {', '.join(pinned)}" if pinned else "timed")
    return plan


def _made(model, plan: Plan) -> dict[str, str]:
    out = {}
    if model.dtype in HALF:
        out["attention"] = "float32" if plan.kv_dtype == torch.float32 else "model"
    if model.dtype in PACKED:
        out["prepack" if model.dtype in HALF else "fp32-prepack"] = "on" if plan.prepacked else "off"
    out["per-row"] = "on" if plan.per_row else "off"
    if plan.per_row and model.dtype == torch.float32:
        out["row-kernel"] = "on" if plan.row_kernel else "off"
    if plan.kv_dtype == torch.float32:
        out["attention-kernel"] = "on" if plan.query_attention else "off"
    return out


def kernel_products(model, pinned: bool | None):
    """The row kernel's forward maker (kernel.row_forward) for a float32 model's per-row products,
    or None: pinned off, another dtype, not built here, or its packed weights would take more than
    PREPACK_MEMORY_SHARE of the host's free memory (the reason logged)."""
    if pinned is False or model.dtype != torch.float32 or kernel.library() is None:
        return None
    if any(m.weight.dtype != torch.float32 for m in row_modules(model)):
        log.info("%s: the row kernel not used: not every matmul weight is float32", type(model).__name__)
        return None
    exact = {m: kernel.bf16_exact(m.weight.detach()) for m in row_modules(model)}  # each weight tested once, here
    extra = sum(m.weight.numel() * (2 if half else 4) for m, half in exact.items())  # row_forward's panels
    free = available_memory_bytes()
    if free is not None and extra > PREPACK_MEMORY_SHARE * free:
        log.info("%s: the row kernel not used: its packed weights' %.2f GiB would pass %.0f%% of the %.2f GiB free",
                 type(model).__name__, extra / 2**30, 100 * PREPACK_MEMORY_SHARE, free / 2**30)
        return None
    return lambda m: kernel.row_forward(m, half=exact.get(m))


def _choose(model, per_row: bool | None, prepack: bool | None, attention: str | None, timer, row_kernel: bool | None,
            query: bool) -> Plan:
    """prepack: the pin of the model's dtype's prepacking (prepack or fp32_prepack); query: whether a
    float32 cache may attend through the query attention (timed so against the model's dtype)."""
    plan = Plan(kv_dtype=model.dtype, per_query=True)
    name = f"{type(model).__name__} in {model.dtype}"
    if model.dtype in HALF:
        if attention is None:
            with torch.inference_mode():
                plan.kv_dtype = faster_attention(model, timer=timer, query=query)
        else:
            plan.kv_dtype = torch.float32 if attention == "float32" else model.dtype
        log.info("%s: KV cache and attention in %s on this CPU", name, plan.kv_dtype)
    unpacked = packed_rows = None
    plain = None  # float32: the plain GEMMs' row counts, which prepacking is weighed against
    if model.dtype in PACKED and per_row is not True and prepack is not False:
        if model.dtype == torch.float32:
            plain = calibrate_rows(model)
        # ({module: plain forward}, float32: the packed products' rows), or None
        unpacked, packed_rows = prepack_weights(model, force=bool(prepack), timer=timer, plain_rows=plain) or (None, None)
    mods = row_modules(model)
    if per_row is True:
        rows = None
    elif unpacked is not None:
        rows = packed_rows or calibrate_rows(model)  # half precision calibrates the packed products here
    else:
        rows = plain or calibrate_rows(model)
    if unpacked is not None:
        if rows is None:  # no row counts agree: back to the plain forwards, so per-row products can be tried
            for m, fwd in unpacked.items():
                m.forward = fwd
        else:  # kept, without per-row products (slower than GEMMs in bf16)
            plan.prepacked = True
            per_row = False
    if per_row is not False and (per_row or rows is None or rows[0] > 1):
        probes: dict = {}  # the per-row forwards of the modules calibrated and timed (a few of each kind), kept
        fast = kernel_products(model, row_kernel)

        def probe(m):
            if m not in probes:
                probes[m] = fast(m) if fast else per_row_forward(m)
            return probes[m]

        # timed first: calibrating per-row products costs far more where they are slow (bf16 here: a minute)
        pays = per_row or rows is None or per_row_pays(model, rows[0], probe, timer)
        per = calibrate_rows(model, forward_of=probe) if pays else None
        if per is not None and per[0] == 1:
            held = holders(model)
            gemm = {m: m.forward for m in mods}
            halves = 0  # row kernel products whose weight is packed in bfloat16 (exact: kernel.row_forward)
            for m in mods:
                own = (probes.get(m) or fast(m)) if fast else per_row_forward(m, own_weight=held[id(m.weight)] == 1)
                halves += fast is not None and own.packed.dtype == torch.bfloat16
                m.forward = blocked(own, per[1], gemm[m])
            plan.rows, plan.pad_to, plan.top, plan.per_row, plan.row_kernel = per, 1, PER_ROW_LEAD, True, fast is not None
            log.info("%s: per-row matmul products (no padding rows%s), blocks of up to %d rows", name,
                     f", through the row kernel, {halves} of {len(mods)} weights packed in bfloat16 (their values are bfloat16's)"
                     if fast else "", per[1])
            return plan
        if per_row:
            rows = calibrate_rows(model)
    plan.rows = rows
    if rows is None:
        plan.pad_to = 4  # the old fixed rule
        log.warning("%s: no row counts give this CPU's matmuls the same numbers per row; a session's numbers may "
                    "change with its batch-mates (only near-ties can flip)", name)
        return plan
    plan.pad_to, plan.top = rows
    for m in mods:
        m.forward = blocked(m.forward, rows[1])
    log.info("%s: matmuls padded to %d rows, cut into blocks of %d-%d rows", name, rows[0], *rows)
    return plan
