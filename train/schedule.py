"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

Progress is the larger of the step fraction and the wall-clock fraction, so a run with a time
budget anneals its learning rate before the budget ends instead of being cut off at a high one.
"""

from __future__ import annotations

import math


def progress(step: int, max_steps: int, elapsed_s: float, max_seconds: float | None) -> float:
    p = step / max(1, max_steps)
    if max_seconds:
        p = max(p, elapsed_s / max_seconds)
    return min(1.0, p)


def learning_rate(step: int, frac: float, peak: float, warmup_steps: int, floor_ratio: float = 0.1) -> float:
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    floor = peak * floor_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * frac))
