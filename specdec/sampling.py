"""The sampling transform T(logits; temperature, top_k, top_p) -> probabilities.

Both services call exactly this code: the draft samples from T(draft logits) and reports it,
the verifier compares against T(target logits). Any difference between the two sides would
silently change the output distribution (DESIGN.md §3).

`probs_from_logits_rows` is the same transform over rows with settings of their own (the
verifier's batch of sessions), row for row bitwise equal to `probs_from_logits` on the CPU.

Random numbers are keyed, not streamed: every uniform is a hash of (request seed, absolute
position, purpose, index) (`keyed_uniforms`, counter-based, int64 tensor ops on any device),
so the same request gives the same tokens however its rounds were timed, batched or pre-drafted,
on any device, with no generator state and no host sync (DESIGN.md §3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32. Greedy gives the argmax one-hot."""
    logits = logits.float()
    if s.greedy:
        # first index on ties, as torch.argmax
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = (logits / s.temperature).clamp(max=FLOAT_MAX)  # an overflowed (+inf) logit: all the mass, not a NaN row
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties in index order on every device
        # keep a token if the mass strictly before it is < top_p: the smallest nucleus >= top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def probs_from_logits_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V]; temperature, top_k, top_p [N]: each row's own Sampling, on the CPU (host data:
    they are copied to the device, and a filter no row uses is skipped without a device sync).
    -> probabilities [N, V] float32, each row bitwise what probs_from_logits gives it on the CPU
    (the same ops, with the settings cast to float32 as a Python scalar is)."""
    logits = logits.float()
    N, V = logits.shape
    dev = logits.device
    greedy = temperature == 0  # [N]
    use_k = (top_k > 0) & (top_k < V)  # [N]
    use_p = top_p < 1.0  # [N]
    t = to_device(torch.where(greedy, 1.0, temperature).float(), dev)  # [N]
    x = (logits / t[:, None]).clamp(max=FLOAT_MAX)  # [N, V]; as probs_from_logits
    if use_k.any():
        k = torch.where(use_k, top_k, 1)  # [N]
        kth = torch.topk(x, int(k.max()), dim=-1).values.gather(1, to_device(k - 1, dev)[:, None])  # [N, 1] the k-th largest
        x = torch.where(to_device(use_k, dev)[:, None], x.masked_fill(x < kth, float("-inf")), x)
    probs = torch.softmax(x, dim=-1)  # [N, V]
    if use_p.any():
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [N, V]
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= to_device(top_p.float(), dev)[:, None])
        kept = probs.masked_fill(drop, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        probs = torch.where(to_device(use_p, dev)[:, None], kept, probs)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)  # [N, V]
        probs = torch.where(to_device(greedy, dev)[:, None], one_hot, probs)
    return probs


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host data to the device without waiting for the work queued there (a blocking copy to a
    GPU would first sync its stream)."""
    return x.to(device, non_blocking=True)


def wait(device: torch.device) -> None:
    """Waits for the device's work so far (a no-op on the CPU), with the GIL released: a stream's
    synchronize releases it, where a bare .tolist() may wait holding it, and the event loop that
    shares the process would stall for the whole pass."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_host(x: torch.Tensor) -> list:
    """A small device result as Python lists, once the device is done (`wait`)."""
    wait(x.device)
    return x.tolist()


def sparsify(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [V] -> (ids [k'], renormalized probs [k']) of its top-k nonzero entries (k' <= k)."""
    vals, ids = torch.topk(probs, min(k, probs.shape[-1]))
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    return ids, vals / vals.sum()


# purposes of a keyed draw
VERIFY = 0  # the verifier's uniforms of one round (index 0..tau)
DRAFT = 1  # the draft's sample at one position (index 0)
DRAFT_TREE = 2  # a tree draft's samples in one round (index: the parent node and the sibling's rank; draft_service/tree.py)

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 (SplitMix64's increment) as a signed int64
_M1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_M2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def int64(x: int) -> int:
    """A Python int as the signed int64 with the same low 64 bits (a uint64 seed)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64: torch's >> is arithmetic, so mask off the copied sign bits."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _fmix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer (a bijection on 64 bits); int64 products wrap in torch."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def keyed_uniforms(seed, position, purpose, index, device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 uniforms in [0, 1) from the key (seed, position, purpose, index): Python ints
    (any seed; wrapped to int64) or int64 tensors (seeds already int64()), broadcast together.
    Counter-based: h = fmix(h * golden + x + 1) over the four parts, then the top 53 bits, so a
    value depends on its key only, never on the batch or device it is computed in."""
    h = torch.zeros((), dtype=torch.long, device=device)
    for x in (seed, position, purpose, index):
        x = to_device(x, device) if isinstance(x, torch.Tensor) else int64(x)  # a Python int stays a scalar operand: no copy
        h = _fmix(h * _GOLDEN + x + 1)
    return _shr(h, 11).double() * 2.0**-53  # 53 bits: at most 1 - 2^-53


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V], u [...] uniforms in [0, 1) -> ids [...] (int64, on the
    device, no host sync). float64 sums, and a token with no mass is never returned."""
    c = probs.double().cumsum(-1)  # [..., V]
    total = c[..., -1:]  # [..., 1]
    x = torch.minimum(u.double().unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))  # [..., 1], < total
    # the first index whose cdf exceeds x: its own mass is > 0, so a token with no mass never comes out
    return torch.searchsorted(c, x, right=True).squeeze(-1)


def sample(probs: torch.Tensor, seed: int, position: int, purpose: int) -> int:
    """One draw from probs [V] with the keyed uniform at (seed, position, purpose, 0) (a host
    sync: draft side). Raises ValueError where probs has no mass to draw from (NaN logits)."""
    t = int(sample_with(probs, keyed_uniforms(seed, position, purpose, 0, device=probs.device)))
    if t >= probs.shape[-1]:
        raise ValueError("the model's probabilities have no mass to draw from (its logits are not finite)")
    return t
