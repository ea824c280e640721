"""The resumable training loop shared by pre-training and distillation.

It owns what both need: automatic resume from ``run_dir/checkpoint.pt``, AdamW, warm-up +
cosine learning rate (see ``schedule``), gradient clipping, optional bf16 autocast (on the model's device: the CPU or a GPU), a tqdm
progress bar, optional ``torch.compile`` of the loss, a JSON-lines loss log (``run_dir/log.jsonl``), a checkpoint every few minutes
and at the end, and two limits: a step count and a wall-clock budget (``max_minutes`` counts
training time across resumed runs).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from tqdm import tqdm

from train import checkpoint, schedule


@dataclass
class LoopConfig:
    run_dir: Path
    max_steps: int
    max_minutes: float | None = None
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True
    checkpoint_minutes: float = 5.0
    log_every: int = 10
    desc: str = "train"
    compile: bool = False  # torch.compile the forward and loss (H100: 33 s of warm-up, then 2x the tokens/s)


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def run(model, batch_fn: Callable[[int], torch.Tensor],
        loss_fn: Callable[[torch.nn.Module, torch.Tensor], Tuple[torch.Tensor, Dict[str, float]]],
        cfg: LoopConfig) -> Dict[str, float]:
    """Train ``model`` until ``max_steps`` or the time budget; returns a summary dict."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    step, elapsed = 0, 0.0
    state = checkpoint.load(run_dir)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed_s"]
        print(f"[{cfg.desc}] resumed from {run_dir / checkpoint.CKPT_NAME} at step {step} "
              f"({elapsed / 60:.1f} min trained)", flush=True)
    max_s = cfg.max_minutes * 60 if cfg.max_minutes else None
    # the compiled step shares the model's parameters; checkpoints save the model itself
    step_fn = torch.compile(loss_fn) if cfg.compile else loss_fn
    first_step = step
    model.train()
    log = open(run_dir / "log.jsonl", "a")
    bar = tqdm(total=cfg.max_steps, initial=step, desc=cfg.desc, dynamic_ncols=True, mininterval=5)
    last_ckpt = time.monotonic()
    t_resume = time.monotonic()
    elapsed0 = elapsed
    tokens_per_step = None
    last = {}
    try:
        while step < cfg.max_steps and not (max_s and elapsed >= max_s):
            frac = schedule.progress(step, cfg.max_steps, elapsed, max_s)
            lr = schedule.learning_rate(step, frac, cfg.lr, cfg.warmup_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = batch_fn(step).to(device, non_blocking=True)
            tokens_per_step = batch[:, 1:].numel()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                try:
                    loss, metrics = step_fn(model, batch)
                except Exception as e:  # noqa: BLE001 - a compiler failure falls back to eager, once
                    if step_fn is loss_fn or step > first_step:
                        raise
                    print(f"[{cfg.desc}] torch.compile failed ({type(e).__name__}: {e}); training eagerly", flush=True)
                    step_fn = loss_fn
                    loss, metrics = step_fn(model, batch)
            metrics = {k: float(v) for k, v in metrics.items()}
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            elapsed = elapsed0 + (time.monotonic() - t_resume)
            last = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(gnorm),
                    "elapsed_s": round(elapsed, 2), "tokens": step * tokens_per_step, **metrics}
            if not torch.isfinite(loss.detach()):
                raise FloatingPointError(f"non-finite loss at step {step}")
            if step % cfg.log_every == 0 or step == 1:
                log.write(json.dumps(last) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr:.2e}")
            bar.update(1)
            if time.monotonic() - last_ckpt >= cfg.checkpoint_minutes * 60:
                checkpoint.save(run_dir, model, opt, step, elapsed)
                last_ckpt = time.monotonic()
    finally:
        bar.close()
        if last:
            log.write(json.dumps(last) + "\n")
            checkpoint.save(run_dir, model, opt, step, elapsed)
        log.close()
    model.eval()
    return {"steps": step, "elapsed_s": elapsed,
            "tokens": step * (tokens_per_step or 0), "final_loss": last.get("loss")}
