"""The resumable training loop shared by pre-training and distillation.

It owns what both need: automatic resume from ``run_dir/checkpoint.pt``, AdamW, warm-up +
cosine learning rate (see ``schedule``), gradient clipping, optional bf16 autocast (on the model's device: the CPU or a GPU), a tqdm
progress bar, optional ``torch.compile`` of the loss, a JSON-lines loss log (``run_dir/log.jsonl``), a checkpoint every few minutes
and at the end, and two limits: a step count (``max_steps``, counted across resumed runs) and a
training-time budget for this run (``max_minutes``: a resumed run trains that long again, from
where it stopped). The progress bar's total and ETA follow whichever limit ends the run first.
The learning-rate schedule is the one of a single run given the total (the minutes trained
before plus this run's budget), so a resumed run picks the cosine up again part-way.
"""

from __future__ import annotations

import json
import sys
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
    identity: dict | None = None  # what the run trains (distill: the target, the draft's shape); saved with each
    # checkpoint, and a checkpoint saved with another is refused (one without any resumes)


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _last_logged(run_dir: Path) -> dict:
    """The last line of the loss log (checkpoints from before they kept it)."""
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return {}
    return json.loads(lines[-1]) if lines else {}


def _check_identity(run_dir: Path, saved: dict | None, cfg: LoopConfig) -> None:
    """Refuses to resume a checkpoint saved with another identity, in one line saying what differs."""
    if saved is None or cfg.identity is None or saved == cfg.identity:
        return
    diff = "; ".join(f"{k} {saved.get(k)} (now {cfg.identity.get(k)})"
                     for k in dict.fromkeys([*cfg.identity, *saved]) if saved.get(k) != cfg.identity.get(k))
    raise SystemExit(f"{cfg.desc}: the checkpoint in {run_dir} is of another run ({diff}): give another --run-dir, "
                     f"or remove {run_dir} to start over")


def planned_steps(step: int, max_steps: int, run_steps: int, run_elapsed_s: float, budget_s: float | None) -> int:
    """The step the run will end at: ``max_steps``, or sooner if this run's time budget runs out
    first at the rate of its ``run_steps`` steps so far."""
    if not budget_s or run_steps <= 0 or run_elapsed_s <= 0:
        return max_steps
    more = int(max(0.0, budget_s - run_elapsed_s) * run_steps / run_elapsed_s)
    return max(step, min(max_steps, step + more))


def run(model, batch_fn: Callable[[int], torch.Tensor],
        loss_fn: Callable[[torch.nn.Module, torch.Tensor], Tuple[torch.Tensor, Dict[str, float]]],
        cfg: LoopConfig) -> Dict[str, float]:
    """Train ``model`` until ``max_steps`` or the time budget; returns a summary dict."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    step, elapsed, last = 0, 0.0, {}
    state = checkpoint.load(run_dir)
    if state is not None:
        _check_identity(run_dir, (state.get("extra") or {}).get("identity"), cfg)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed_s"]
        last = (state.get("extra") or {}).get("last") or _last_logged(run_dir)
        print(f"[{cfg.desc}] resumed from {run_dir / checkpoint.CKPT_NAME} at step {step} "
              f"({elapsed / 60:.1f} min trained)", flush=True)
    max_s = cfg.max_minutes * 60 if cfg.max_minutes is not None else None
    # the compiled step shares the model's parameters; checkpoints save the model itself
    step_fn = torch.compile(loss_fn) if cfg.compile else loss_fn
    first_step = step
    model.train()
    log = open(run_dir / "log.jsonl", "a")
    bar = tqdm(total=max(step, cfg.max_steps), initial=step, desc=cfg.desc, dynamic_ncols=True, mininterval=5)
    last_ckpt = time.monotonic()
    t_resume = time.monotonic()
    elapsed0 = elapsed
    tokens_per_step = None
    tokens_in_all = last.get("tokens", 0) or 0  # a running total: a resume may change --batch-size or --seq-len
    tokens_this_run = 0
    run_s = 0.0
    total_s = elapsed + max_s if max_s is not None else None
    ident = {"identity": cfg.identity} if cfg.identity is not None else {}
    interrupted = False
    try:
        while step < cfg.max_steps and not (max_s is not None and run_s >= max_s):
            frac = schedule.progress(step, cfg.max_steps, elapsed, total_s)
            lr = schedule.learning_rate(step, frac, cfg.lr, cfg.warmup_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = batch_fn(step).to(device, non_blocking=True)
            tokens_per_step = batch[:, 1:].numel()
            tokens_in_all += tokens_per_step
            tokens_this_run += tokens_per_step
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
            if not (torch.isfinite(loss.detach()) and torch.isfinite(gnorm)):  # before the step: the weights stay the last good ones
                raise FloatingPointError(f"non-finite loss or gradient at step {step + 1}; the last checkpoint keeps step {step}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            run_s = time.monotonic() - t_resume
            elapsed = elapsed0 + run_s
            last = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(gnorm),
                    "elapsed_s": round(elapsed, 2), "tokens": tokens_in_all, **metrics}
            if step % cfg.log_every == 0 or step == 1:
                log.write(json.dumps(last) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr:.2e}")
            bar.total = planned_steps(step, cfg.max_steps, step - first_step, run_s, max_s)
            bar.update(1)
            if time.monotonic() - last_ckpt >= cfg.checkpoint_minutes * 60:
                checkpoint.save(run_dir, model, opt, step, elapsed, {"last": last, **ident})
                last_ckpt = time.monotonic()
    except KeyboardInterrupt:  # Ctrl-C: the checkpoint below keeps the run; one line, not a traceback
        interrupted = True
    finally:
        bar.total = step  # the run ended here, whichever limit ended it
        bar.close()
        if step > first_step:
            log.write(json.dumps(last) + "\n")
            checkpoint.save(run_dir, model, opt, step, elapsed, {"last": last, **ident})
        log.close()
    if interrupted:
        kept = (f"the checkpoint in {run_dir} keeps step {step}: the same command resumes there" if step
                else "nothing trained yet")
        print(f"{cfg.desc}: interrupted at step {step}; {kept}", file=sys.stderr, flush=True)
        raise SystemExit(130)
    model.eval()
    run_steps = step - first_step
    finals = {f"final_{k}": v for k, v in last.items() if k not in ("step", "loss", "lr", "grad_norm", "elapsed_s", "tokens")}
    return {"steps": step, "elapsed_s": elapsed, "tokens": last.get("tokens", 0), "final_loss": last.get("loss"), **finals,
            "resumed_from_step": first_step, "steps_this_run": run_steps, "minutes_this_run": round(run_s / 60, 3),
            "tokens_this_run": tokens_this_run,
            "stopped_by": "steps" if step >= cfg.max_steps else "max-minutes"}


def causal_lm_loss(model, batch):
    """Next-token cross-entropy on a batch of windows [B, T]: the plain pretraining and distillation base loss."""
    out = model(input_ids=batch[:, :-1])
    logits = out.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    return loss, {}
