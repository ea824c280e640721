"""The engine on a GPU: random-weight models of real shapes, measured in-process through the verify
scheduler (the engine without gRPC), against transformers' generate() on the same model.

    python -m bench.gpu [--shape llama3-8b|llama-1b|tiny] [--device cuda] [--dtype bfloat16] [--out bench/results/gpu]

Measures
  * target-only tokens/s through the scheduler vs generate() (greedy, same prompt, same dtype);
  * per-round overhead: wall time of a round minus the target's pass;
  * verify batch throughput at 1, 8, 32 and 64 concurrent sessions (tau=4, acceptance alpha=0.8);
  * speculative speed with a synthetic proposer whose acceptance is set exactly (it proposes the
    engine's own target-only greedy token with probability alpha, else another token), alpha in 0.5/0.7/0.9,
    draft cost zero: the verify side's share of the speed-up.
Every timed run follows an identical untimed one (per-shape kernel set-up is not decoding). Writes
its report into --out: a markdown table, gpu.json and (if matplotlib is there) gpu.png; the H100
run is bench/results/gpu/. `--shape tiny` runs on the CPU in seconds: the test suite runs it as a
smoke test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specdec.lm import LM, resolve_device
from specdec.sampling import Sampling
from specdec.v1 import specdec_pb2 as pb
from verify_service.scheduler import Scheduler

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
    "tiny": (64, 2, 4, 2, 128, 256),
}


def build(shape: str, path: str, context: int, device: torch.device) -> str:
    h, n, heads, kv, inter, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                      vocab_size=vocab, max_position_embeddings=context, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(cfg)  # fail early on a bad shape, cheaply
    with device:  # random init where the model will run: an 8B init on the host takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    from specdec.testing.tinymodels import word_tokenizer  # noqa: PLC0415 - the bench's tokenizer: ids only

    word_tokenizer(vocab).save_pretrained(path)
    return path


def sync(lm: LM) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


class Proposer:
    """Proposes the target's greedy token with probability alpha, else a wrong one (seeded)."""

    def __init__(self, reference: list[int], alpha: float, vocab: int, seed: int = 0):
        self.ref, self.alpha, self.vocab, self.rng = reference, alpha, vocab, random.Random(seed)

    def propose(self, at: int, tau: int) -> list[int]:
        out = []
        for i in range(at, min(at + tau, len(self.ref))):
            good = self.rng.random() < self.alpha
            out.append(self.ref[i] if good else (self.ref[i] + 1) % self.vocab)
        return out


async def run_session(eng: Scheduler, prompt: list[int], n: int, tau: int, proposer: Proposer | None) -> tuple[int, int, float, list[int]]:
    """Greedy session of n tokens; returns (tokens, rounds, forward seconds, ids)."""
    s = eng.open(prompt, n, Sampling(), seed=0, mode=pb.PROPOSAL_MODE_GREEDY)
    fwd, rounds = 0.0, 0
    try:
        await eng.prefill(s)
        while not s.finish:
            toks = proposer.propose(s.generated, min(tau, s.max_new_tokens - s.generated - 1)) if proposer else []
            v = await eng.step(s, toks, None)
            fwd += v.forward_s
            rounds += 1
        return s.generated, rounds, fwd, s.ids[len(prompt):]
    finally:
        eng.close(s)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu")
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--sessions", default="1,8,32,64")
    p.add_argument("--out", default=os.path.join("bench", "results", "gpu"))
    a = p.parse_args(argv)
    context = a.prompt_len + a.tokens + 64
    res: dict = {"shape": a.shape, "dims": SHAPES[a.shape], "dtype": a.dtype, "tokens": a.tokens, "prompt_len": a.prompt_len}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building a random {a.shape} model ...", file=sys.stderr, flush=True)
        t_build = time.perf_counter()
        lm = LM.load(build(a.shape, tmp, context, resolve_device(a.device)), a.device, a.dtype)
        res["device"] = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu"
        res["torch"], res["build_and_load_s"] = torch.__version__, round(time.perf_counter() - t_build, 1)
        prompt = torch.randint(1, lm.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
        # transformers' generate() on the same weights and dtype, with the model's own (sdpa) attention; every
        # timed run below follows an identical untimed one, so per-shape kernel set-up is paid before timing
        engine_attn = lm.model.config._attn_implementation
        lm.model.set_attn_implementation("sdpa")
        ids = torch.tensor([prompt], device=lm.device)
        kw = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
        with torch.inference_mode():
            lm.model.generate(ids, **kw)  # warm-up
            sync(lm)
            t0 = time.perf_counter()
            reference = lm.model.generate(ids, **kw)[0, len(prompt):].tolist()
            sync(lm)
            res["generate_tok_s"] = a.tokens / (time.perf_counter() - t0)
            checkpoint(res, a.out)
        lm.model.set_attn_implementation(engine_attn)
        eng = Scheduler(lm, max_sessions=max(int(x) for x in a.sessions.split(",")))

        async def bench() -> None:
            await run_session(eng, prompt, a.tokens, 0, None)  # warm-up
            t0 = time.perf_counter()
            n, rounds, fwd, out = await run_session(eng, prompt, a.tokens, 0, None)
            wall = time.perf_counter() - t0
            res["target_only_tok_s"] = n / wall
            res["target_only_equals_generate"] = out == reference
            res["target_only_first_difference"] = next((i for i, (x, y) in enumerate(zip(out, reference)) if x != y), None)
            own = out  # the engine's own greedy output: the synthetic proposer's source, so alpha is what it says
            res["overhead_ms_per_round_target_only"] = 1e3 * (wall - fwd) / rounds
            checkpoint(res, a.out)
            res["speculative"] = {}
            for alpha in (0.5, 0.7, 0.9):
                await run_session(eng, prompt, a.tokens, 4, Proposer(own, alpha, lm.vocab_size))  # warm-up
                t0 = time.perf_counter()
                n, rounds, fwd, out = await run_session(eng, prompt, a.tokens, 4, Proposer(own, alpha, lm.vocab_size))
                wall = time.perf_counter() - t0
                res["speculative"][str(alpha)] = {"tok_s": n / wall, "tokens_per_round": n / rounds, "equals_generate": out == reference,
                                                  "equals_target_only": out == own,
                                                  "overhead_ms_per_round": 1e3 * (wall - fwd) / rounds}
                checkpoint(res, a.out)
            res["batch"] = {}
            for k in [int(x) for x in a.sessions.split(",")]:
                t0 = time.perf_counter()
                outs = await asyncio.gather(*[run_session(eng, prompt, a.tokens, 4, Proposer(own, 0.8, lm.vocab_size, seed=i)) for i in range(k)])
                wall = time.perf_counter() - t0
                res["batch"][str(k)] = {"tok_s": sum(o[0] for o in outs) / wall, "tokens_per_round": sum(o[0] for o in outs) / sum(o[1] for o in outs), "all_equal_generate": all(o[3] == reference for o in outs),
                                        "all_equal_target_only": all(o[3] == own for o in outs)}
                checkpoint(res, a.out)

        asyncio.run(bench())
        eng.shutdown()
    write(res, a.out)


def checkpoint(res: dict, out: str) -> None:
    """gpu.json after each stage, so a run cut short still leaves what it measured."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res), file=sys.stderr, flush=True)


def write(res: dict, out: str) -> None:
    checkpoint(res, out)
    g = res["generate_tok_s"]
    lines = [f"# Engine on {res['device']}: random {res['shape']} {res['dims']}, {res['dtype']}, prompt {res['prompt_len']}, "
             f"{res['tokens']} tokens, greedy", "",
             "| what | tok/s | vs generate() | identical to generate() | identical to target-only |", "|---|---|---|---|---|",
             f"| transformers generate() | {g:.1f} | 1.00x | - | - |",
             f"| scheduler target-only | {res['target_only_tok_s']:.1f} | {res['target_only_tok_s'] / g:.2f}x | {res['target_only_equals_generate']} | - |"]
    for alpha, r in res["speculative"].items():
        lines.append(f"| speculative tau=4, alpha={alpha} (draft cost 0; {r['tokens_per_round']:.2f} tokens/round) | {r['tok_s']:.1f} | {r['tok_s'] / g:.2f}x "
                     f"| {r['equals_generate']} | {r['equals_target_only']} |")
    lines += ["", f"Overhead per round (wall - target pass): target-only {res['overhead_ms_per_round_target_only']:.2f} ms; "
              + ", ".join(f"alpha={k}: {r['overhead_ms_per_round']:.2f} ms" for k, r in res["speculative"].items()), "",
              "| concurrent sessions (tau=4, alpha=0.8) | total tok/s | tokens per round | all identical to generate() | all identical to target-only |",
              "|---|---|---|---|---|"]
    lines += [f"| {k} | {r['tok_s']:.1f} | {r['tokens_per_round']:.2f} | {r['all_equal_generate']} | {r['all_equal_target_only']} |"
              for k, r in res["batch"].items()]
    with open(os.path.join(out, "GPU.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        ks = list(res["batch"])
        plt.figure(figsize=(5, 3.5))
        plt.plot([int(k) for k in ks], [res["batch"][k]["tok_s"] for k in ks], marker="o")
        plt.xscale("log", base=2)
        plt.xlabel("concurrent sessions")
        plt.ylabel("total tokens/s")
        plt.title(f"verify batch throughput ({res['shape']}, {res['device']})")
        plt.tight_layout()
        plt.savefig(os.path.join(out, "gpu.png"), dpi=100)
    except ImportError:
        pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
