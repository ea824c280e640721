"""Resumable training state: model, optimizer, step, elapsed training time, written atomically
(temporary file then rename) so a run killed while saving never leaves a broken checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CKPT_NAME = "checkpoint.pt"


def save(run_dir: Path, model, optimizer, step: int, elapsed_s: float, extra: dict | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "elapsed_s": elapsed_s,
        "extra": extra or {},
    }
    tmp = run_dir / (CKPT_NAME + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run_dir / CKPT_NAME)


def load(run_dir: Path):
    """The saved state dict, or None if the run directory has no checkpoint."""
    path = run_dir / CKPT_NAME
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
