"""What the engine decided at load for one model on one device (held by `Engine`, never set on
the Hugging Face model). Its CPU choices are spelled as --engine-choices spells them
(`Plan.choices`; specdec/choices.py parses them back)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Plan:
    kv_dtype: torch.dtype  # the dtype the pool is kept and attended in
    pad_to: int = 1  # a pass has at least this many rows (the CPU's calibrated lo; a GPU pads nothing)
    top: int | None = None  # a prefill chunk (no logits) of more tokens goes through every matmul in a product of its own
    rows: tuple[int, int] | None = None  # the CPU's calibrated row counts (lo, hi), if any agree
    per_row: bool = False  # per-row matmul products (cpu/rows.py)
    row_kernel: bool = False  # ... through the row kernel (cpu/kernel.py; float32)
    prepacked: bool = False  # weights prepacked for oneDNN (cpu/prepack.py; the choice prepack, fp32-prepack in float32)
    per_query: bool = False  # attention: each query its own problem (the CPU's bitwise invariance), layout.Pass
    query_attention: Callable | None = field(default=None, repr=False)  # ... through the CPU tier's kernel (cpu/kernel.py), not SDPA
    graphs: bool = False  # uniform passes of rounds captured as CUDA graphs (graphs.py)
    compiled: bool = False  # the decoder layers compiled (compiled.py)
    made: dict[str, str] = field(default_factory=dict)  # the CPU choices as --engine-choices spells them

    def choices(self) -> str:
        """The choices in --engine-choices' format ('' on a GPU): given back at the next start they are
        made again without timing (the checks still run), so the engine computes the same numbers."""
        return ",".join(f"{k}={v}" for k, v in self.made.items())
