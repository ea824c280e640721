"""The engine on a GPU: random-weight models of real shapes, measured in-process through the verify
scheduler (the engine without gRPC), against transformers' generate() on the same model.

    python -m bench.gpu [--shape llama3-8b|llama-1b|tiny] [--device cuda] [--dtype bfloat16] [--out bench/results/gpu]
                        [--profile] [--compiled-baseline|--no-compiled-baseline] [--compile-layers] [--max-prefill-rows N]

Measures
  * target-only tokens/s through the scheduler vs generate() (greedy, same prompt, same dtype);
  * per-round overhead: wall time of a round minus the target's pass;
  * verify batch throughput at 1, 8, 32 and 64 concurrent sessions (tau=4, acceptance alpha=0.8);
  * speculative speed with a synthetic proposer whose acceptance is set exactly (it proposes the
    engine's own target-only greedy token with probability alpha, else another token), alpha in 0.5/0.8/0.9,
    draft cost zero: the verify side's share of the speed-up;
  * last, after every other stage (`--compiled-baseline`, on by default on cuda only): generate() with a
    static KV cache and torch.compile mode "reduce-overhead" (CUDA graphs), what a user chasing GPU
    latency runs: its warm-up (the first call, compilation included), tokens/s and whether its output is
    plain generate()'s. On the CPU (no CUDA graphs) it compiles in mode "default", and only when asked
    for. A failure is recorded in gpu.json ("error"), not raised; the model's attention and compile state
    are restored afterwards.
With compiled layers (the engine's default on CUDA; `--no-compile-layers` turns them off) the decoder
layers are compiled (specdec/engine/compiled.py; the load's time includes it), and target-only is
timed once more uncompiled, in the same run;
generate() always runs uncompiled. `--max-prefill-rows` sets the scheduler's rows of prompt chunks
per pass (default: its own).
Every timed run follows an identical untimed one (per-shape kernel set-up is not decoding);
generate() and target-only are timed in `--repeats` alternating pairs, and their medians reported. With
`--profile`, after the timed stages, torch.profiler runs over one target-only session and one
generate() of 16 tokens each (prefill included): their op tables (sorted by self CPU time, and on
cuda a second one of the kernels sorted by device time) go to
--out/profile_target_only.txt and --out/profile_generate.txt, and gpu.json's "host_ops_per_token"
holds each one's host-side profiler events (every op call, nested ones included, and on cuda the CUDA
runtime calls) per generated token, which is what launch-bound decoding pays for. Writes its report
into --out: a markdown table, gpu.json and (if matplotlib is there) gpu.png; the H100 run is
bench/results/gpu/. `--shape tiny` runs on the CPU in seconds: the test suite runs it as a smoke test.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specdec.engine.compiled import uncompiled
from specdec.engine.graphs import Uniform
from specdec.lm import LM, resolve_device
from specdec.sampling import Sampling
from specdec.v1 import specdec_pb2 as pb
from bench.gpu_report import PassLog, checkpoint, replay_ms, write
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
    from bench.tinymodels import word_tokenizer  # noqa: PLC0415 - the bench's tokenizer: ids only

    word_tokenizer(vocab).save_pretrained(path)
    return path


def sync(lm: LM) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


@contextlib.contextmanager
def own_attention(lm: LM):
    """transformers' own (sdpa) attention and uncompiled layers for generate(); the engine's attention back afterwards."""
    engine_attn = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("sdpa")
    try:
        with uncompiled(lm.engine.compiled):
            yield
    finally:
        lm.model.set_attn_implementation(engine_attn)


def activities(lm: LM) -> list:
    return [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if lm.device.type == "cuda" else [])


def op_table(prof, tokens: int, path: str) -> float:
    """Writes the profile's op table to path; returns its host-side events (op calls) per generated token."""
    with open(path, "w") as fh:
        fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        if any(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()):  # the kernels, by device time
            fh.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40) + "\n")
    return sum(e.device_type == torch.autograd.DeviceType.CPU for e in prof.events()) / tokens


def profiled_scheduler(lm: LM) -> tuple[Scheduler, torch.profiler.profile]:
    """A scheduler whose thread, the one that runs the model, runs under torch.profiler for its whole life
    (Scheduler's thread_context): the profiler records ops on the thread it is started on only (the session's
    own few ops on the event loop's thread, opening and closing it, are left out)."""
    prof = torch.profiler.profile(activities=activities(lm))
    return Scheduler(lm, max_sessions=1, thread_context=lambda: prof), prof


def compiled_generate(lm: LM, ids: torch.Tensor, kw: dict, reference: list[int]) -> dict:
    """generate() with a static KV cache and torch.compile (reduce-overhead: CUDA graphs; on the CPU, default)."""
    from transformers import CompileConfig  # noqa: PLC0415

    cuda = lm.device.type == "cuda"
    cc = CompileConfig(mode="reduce-overhead" if cuda else "default")
    cc._compile_all_devices = not cuda  # generate() compiles on the CPU only when told to
    kw = dict(kw, cache_implementation="static", compile_config=cc)
    r = {"mode": cc.mode, "tok_s": None, "warmup_s": None, "second_call_s": None, "equals_generate": None, "error": None}
    try:
        # generate()'s own no_grad, not inference_mode: the documented compile path; dynamo's defaults (compiled
        # layers leave module ints symbolic, which a whole-model compile need not pay for)
        with own_attention(lm), torch._dynamo.config.patch(allow_unspec_int_on_nn_module=False):
            for key in ("warmup_s", "second_call_s"):  # the first call compiles (and records the graphs), the second is the untimed one
                t0 = time.perf_counter()
                lm.model.generate(ids, **kw)
                sync(lm)
                r[key] = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = lm.model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
            sync(lm)
            r["tok_s"] = kw["max_new_tokens"] / (time.perf_counter() - t0)
            r["equals_generate"] = out == reference
    except Exception as e:  # noqa: BLE001 - a compile failure is a result, not the end of the run
        r["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        for k in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):  # what generate() left on the model
            if hasattr(lm.model, k):
                delattr(lm.model, k)
        torch._dynamo.reset()
    return r


class Proposer:
    """Proposes the engine's own target-only greedy continuation: what a perfect draft would."""

    def __init__(self, reference: list[int]):
        self.ref = reference

    def propose(self, at: int, tau: int) -> list[int]:
        return self.ref[at : at + tau]


class Forced:
    """The scheduler's benchmark-only forced acceptance: each proposal of a round is accepted with
    probability alpha until the first rejection (per session, seeded), so tokens per round are
    (1 - alpha^(tau+1)) / (1 - alpha) on average whatever the random weights' near-ties do."""

    def __init__(self):
        self.alpha = 0.0
        self._rngs: dict[int, random.Random] = {}

    def __call__(self, session, tau: int) -> int:
        rng = self._rngs.setdefault(session.sid, random.Random(session.sid))
        n = 0
        while n < tau and rng.random() < self.alpha:
            n += 1
        return n


async def run_session(eng: Scheduler, prompt: list[int], n: int, tau: int, proposer: Proposer | None) -> tuple[int, int, float, list[int]]:
    """Greedy session of n tokens; returns (tokens, rounds, forward seconds, ids, sessions in its rounds' passes)."""
    s = eng.open(prompt, n, Sampling(), seed=0, mode=pb.PROPOSAL_MODE_GREEDY)
    fwd, rounds, shared = 0.0, 0, 0
    try:
        await eng.prefill(s)
        while not s.finish:
            toks = proposer.propose(s.generated, min(tau, s.max_new_tokens - s.generated - 1)) if proposer else []
            v = await eng.step(s, toks, None)
            fwd += v.forward_s
            rounds += 1
            shared += v.pass_rounds
        return s.generated, rounds, fwd, s.ids[len(prompt):], shared
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
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="timed generate() / target-only pairs, alternating; the medians are reported")
    p.add_argument("--out", default=os.path.join("bench", "results", "gpu"))
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a target-only session and a generate()")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decoder layers (specdec/engine/compiled.py; a GPU only; default: the engine's, on for CUDA)")
    p.add_argument("--max-prefill-rows", type=int, default=None, help="the scheduler's rows of prompt chunks per pass")
    p.add_argument("--compiled-baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="generate() with a static cache and torch.compile, last (default: on for cuda, off for cpu)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    context = a.prompt_len + a.tokens + 64
    res: dict = {"shape": a.shape, "dims": SHAPES[a.shape], "dtype": a.dtype, "tokens": a.tokens, "prompt_len": a.prompt_len, "tau": a.tau}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building a random {a.shape} model ...", file=sys.stderr, flush=True)
        t_build = time.perf_counter()
        lm = LM.load(build(a.shape, tmp, context, resolve_device(a.device)), a.device, a.dtype, compiled=a.compile_layers)
        res["device"] = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu"
        res["torch"], res["build_and_load_s"] = torch.__version__, round(time.perf_counter() - t_build, 1)
        res["cuda_graphs"] = lm.engine.uniform is not None and lm.engine.uniform.graphs
        res["compiled_layers"] = len(lm.engine.compiled)  # 0 where not asked for, or where the compilation failed
        # the weights a decode pass reads: all but the input embedding's table, of which it reads a few rows (a tied head
        # reads it whole, as the head)
        embed = lm.model.get_input_embeddings().weight
        tied = embed is lm.model.get_output_embeddings().weight
        weight_bytes = sum(t.numel() * t.element_size() for t in lm.model.parameters()) - (0 if tied else embed.numel() * embed.element_size())
        prompt = torch.randint(1, lm.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
        # transformers' generate() on the same weights and dtype, with the model's own (sdpa) attention; every
        # timed run below follows an identical untimed one, so per-shape kernel set-up is paid before timing
        ids = torch.tensor([prompt], device=lm.device)
        kw = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)

        def generate() -> tuple[float, list[int]]:
            with own_attention(lm), torch.inference_mode():
                t0 = time.perf_counter()
                out = lm.model.generate(ids, **kw)[0, len(prompt):].tolist()
                sync(lm)
                return a.tokens / (time.perf_counter() - t0), out

        forced = Forced()
        eng = Scheduler(lm, max_sessions=max(int(x) for x in a.sessions.split(",")), forced_acceptance=forced,
                        max_prefill_rows=a.max_prefill_rows)
        res["max_prefill_rows"] = eng.max_prefill_rows
        uniform = lm.engine.uniform
        passlog = PassLog(lm.engine)

        async def timed(k: int, tau: int, proposer: Proposer | None) -> dict:
            """k concurrent sessions (after an identical untimed run): tok/s, and what a round's pass
            costs: its time from the engine's start to the verdicts on the host (pass_ms), the same
            pass's device time (a replay of its CUDA graph, where captured), the host's share of the
            pass, and the bytes a pass must read (weights, keys and values) over its time."""
            await asyncio.gather(*[run_session(eng, prompt, a.tokens, tau, proposer) for _ in range(k)])
            sync(lm)
            passlog.passes.clear()
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[run_session(eng, prompt, a.tokens, tau, proposer) for _ in range(k)])
            wall = time.perf_counter() - t0
            n, rounds = sum(o[0] for o in outs), sum(o[1] for o in outs)
            pass_ms = 1e3 * sum(o[2] for o in outs) / rounds  # every session of a pass sees the same pass time
            device_ms = replay_ms(lm.engine, k, tau + 1)
            kv = k * (a.prompt_len + a.tokens // 2) * kv_bytes_per_token(lm)  # keys and values a pass reads, on average
            return {"tok_s": n / wall, "tokens_per_round": n / rounds, "sessions_per_pass": sum(o[4] for o in outs) / rounds,
                    "pass_kinds": passlog.summary(),
                    "round_ms": 1e3 * wall * k / rounds, "pass_ms": pass_ms,
                    "graph_replay_ms": device_ms, "host_share": None if device_ms is None else max(0.0, 1 - device_ms / pass_ms),
                    "bandwidth_gb_s": (weight_bytes + kv) / (pass_ms / 1e3) / 1e9, "outs": [o[3] for o in outs]}

        async def bench() -> None:
            nonlocal reference
            generate()  # warm-up
            t0 = time.perf_counter()
            await timed(1, 0, None)
            res["first_target_only_s"] = time.perf_counter() - t0  # two sessions, their captures included (compilation: at load)
            runs = []
            for _ in range(a.repeats):  # alternating, so the host's noise hits both alike
                tok_s, reference = generate()
                r = await timed(1, 0, None)
                runs.append((tok_s, r["tok_s"]))
            res["generate_runs_tok_s"], res["target_only_runs_tok_s"] = (list(x) for x in zip(*runs))
            res["generate_tok_s"] = statistics.median(res["generate_runs_tok_s"])
            res["target_only_tok_s"] = statistics.median(res["target_only_runs_tok_s"])
            res["target_only"] = {k: v for k, v in r.items() if k != "outs"}  # the last run's pass figures
            own = r["outs"][0]  # the engine's own greedy output: the proposals, so a forced acceptance commits what the target would
            res["target_only_equals_generate"] = own == reference
            res["target_only_first_difference"] = next((i for i, (x, y) in enumerate(zip(own, reference)) if x != y), None)
            if lm.engine.compiled:  # the same engine, uncompiled (graphs captured anew)
                lm.engine.uniform = Uniform(lm.engine, uniform.graphs) if uniform is not None else None
                with uncompiled(lm.engine.compiled):
                    res["target_only_uncompiled_tok_s"] = (await timed(1, 0, None))["tok_s"]
                lm.engine.uniform = uniform
            if uniform is not None:  # the same engine without uniform passes (no CUDA graphs): the packed eager pass
                lm.engine.uniform = None
                r = await timed(1, 0, None)
                lm.engine.uniform = uniform
                res["target_only_packed_tok_s"] = r["tok_s"]
            checkpoint(res, a.out)
            res["speculative"] = {}
            for alpha in (0.5, 0.8, 0.9):
                forced.alpha = alpha
                r = await timed(1, a.tau, Proposer(own))
                res["speculative"][str(alpha)] = {k: v for k, v in r.items() if k != "outs"} | {
                    "equals_generate": r["outs"][0] == reference, "equals_target_only": r["outs"][0] == own}
                checkpoint(res, a.out)
            forced.alpha = 0.8
            res["batch"] = {}
            for k in [int(x) for x in a.sessions.split(",")]:
                r = await timed(k, a.tau, Proposer(own))
                res["batch"][str(k)] = {k: v for k, v in r.items() if k != "outs"} | {
                    "all_equal_generate": all(o == reference for o in r["outs"]), "all_equal_target_only": all(o == own for o in r["outs"])}
                checkpoint(res, a.out)
            if uniform is not None:
                res["graphs"] = {"captured": uniform.captures, "capture_s": uniform.capture_s, "memory_bytes": uniform.graph_bytes}

        reference: list[int] = []
        asyncio.run(bench())
        if a.profile:  # after every timed stage, so the profiler cannot disturb them
            n = min(16, a.tokens)
            prof_eng, eng_prof = profiled_scheduler(lm)
            asyncio.run(run_session(prof_eng, prompt, n, 0, None))
            prof_eng.shutdown(timeout=None)  # the profiler stops when the thread ends
            res["host_ops_per_token"] = {"tokens": n,
                                         "target_only": op_table(eng_prof, n, os.path.join(a.out, "profile_target_only.txt"))}
            with own_attention(lm), torch.inference_mode(), torch.profiler.profile(activities=activities(lm)) as prof:
                lm.model.generate(ids, **dict(kw, max_new_tokens=n, min_new_tokens=n))
                sync(lm)
            res["host_ops_per_token"]["generate"] = op_table(prof, n, os.path.join(a.out, "profile_generate.txt"))
            checkpoint(res, a.out)
        eng.shutdown()
        if a.compiled_baseline if a.compiled_baseline is not None else lm.device.type == "cuda":
            print("generate() with a static cache and torch.compile ...", file=sys.stderr, flush=True)
            res["generate_compiled"] = compiled_generate(lm, ids, kw, reference)
            checkpoint(res, a.out)
    write(res, a.out)


def kv_bytes_per_token(lm: LM) -> int:
    pool = lm.engine.pool
    return sum(t[0].numel() * t.element_size() for t in pool.k + pool.v)


if __name__ == "__main__":
    main()
