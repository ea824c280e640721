"""What the engine decided at load for one model on one device (held by `Engine`, never set on
the Hugging Face model), and the pins of the CPU's timed choices in --engine-choices' words
(`parse_choices`, the inverse of `Plan.choices`: parsed here, so that a service reads the flag
without importing the CPU tier)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# --engine-choices: each CPU choice's values (cpu/choose.py makes the choices; Plan.made spells them so)
PINS = {"attention": ("float32", "model"), "prepack": ("on", "off"), "fp32-prepack": ("on", "off"), "per-row": ("on", "off")}


@dataclass
class Plan:
    kv_dtype: torch.dtype  # the dtype the pool is kept and attended in
    pad_to: int = 1  # a pass has at least this many rows (the CPU's calibrated lo; a GPU pads nothing)
    top: int | None = None  # a prefill chunk (no logits) of more tokens goes through every matmul in a product of its own
    rows: tuple[int, int] | None = None  # the CPU's calibrated row counts (lo, hi), if any agree
    per_row: bool = False  # per-row matmul products (cpu/rows.py)
    prepacked: bool = False  # weights prepacked for oneDNN (cpu/prepack.py; the choice prepack, fp32-prepack in float32)
    per_query: bool = False  # attention: each query its own problem (the CPU's bitwise invariance), layout.Pass
    graphs: bool = False  # uniform passes of rounds captured as CUDA graphs (graphs.py)
    compiled: bool = False  # the decoder layers compiled (compiled.py)
    made: dict[str, str] = field(default_factory=dict)  # the CPU choices as --engine-choices spells them

    def choices(self) -> str:
        """The choices in --engine-choices' format ('' on a GPU): given back at the next start they are
        made again without timing (the checks still run), so the engine computes the same numbers."""
        return ",".join(f"{k}={v}" for k, v in self.made.items())


def parse_choices(text: str | None) -> dict[str, bool | str]:
    """--engine-choices ('attention=float32,prepack=on,per-row=off', any of them; '' for none) ->
    `choose`'s keyword arguments. ValueError names what is wrong."""
    out: dict[str, bool | str] = {}
    for part in filter(None, (x.strip() for x in (text or "").split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in PINS or value not in PINS[name]:
            raise ValueError(f"--engine-choices: {part!r} is not one of " +
                             ", ".join(f"{n}={'|'.join(v)}" for n, v in PINS.items()))
        key = name.replace("-", "_")
        if key in out:
            raise ValueError(f"--engine-choices: {name} given twice")
        out[key] = value if name == "attention" else value == "on"
    for packed in ("prepack", "fp32_prepack"):
        if out.get(packed) and out.get("per_row"):
            raise ValueError(f"--engine-choices: {packed.replace('_', '-')}=on and per-row=on exclude each other "
                             "(per-row products read the plain weights)")
    return out
