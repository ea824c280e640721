"""The demo: both services on the shipped model pair, a streamed code completion, its stats, and
the speed-up over target-only generation measured in the same run.

    python -m bench.demo [--target DIR --draft DIR --prompt TEXT --max-new-tokens N --tau T]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from client import Client
from specdec.testing.launch import ENV, ROOT, Service

PROMPT = '''import os


def walk_python_files(root):
    """Yield the path of every .py file under root."""
'''


def tiny_pair(path: str) -> tuple[str, str]:
    """Random tiny models, for when the shipped pair is missing (output is gibberish)."""
    from specdec.testing import tinymodels  # needs only what the services need

    return tinymodels.build(os.path.join(path, "target"), seed=0, hidden=256, layers=6, sharpen=4.0, max_context=2048), \
        tinymodels.build(os.path.join(path, "draft"), seed=1, hidden=32, layers=1, sharpen=4.0, max_context=2048)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo")
    p.add_argument("--target", default=os.path.join(ROOT, "models", "stdlib-code-target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "models", "stdlib-code-draft"))
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tau", type=int, default=0, help="draft tokens per round (0 = server default)")
    a = p.parse_args(argv)
    tmp = None
    if not (os.path.isdir(a.target) and os.path.isdir(a.draft)):
        tmp = tempfile.mkdtemp(prefix="specdec-demo-")
        print(f"[demo] shipped models not found; using random tiny models built in {tmp}", file=sys.stderr)
        a.target, a.draft = tiny_pair(tmp)
    env = dict(ENV, OMP_NUM_THREADS="1")  # the two services share this machine's cores: one thread each
    print("[demo] starting verify_service (target) and draft_service (draft) ...", file=sys.stderr)
    verify = Service("verify_service", "--model", a.target, env=env)
    draft = Service("draft_service", "--model", a.draft, "--verify", verify.address, env=env)
    try:
        params = dict(prompt=a.prompt, max_new_tokens=a.max_new_tokens, num_draft_tokens=a.tau)
        with Client(draft.address, timeout=600) as spec, Client(verify.address, target_only=True, timeout=600) as base:
            spec.generate(prompt=a.prompt, max_new_tokens=8)  # warm-up: first calls pay one-off costs
            base.generate(prompt=a.prompt, max_new_tokens=8)
            print(f"\n--- prompt ---\n{a.prompt}--- speculative completion (streamed) ---", flush=True)
            ids, last = [], None
            t0 = time.perf_counter()
            for chunk in spec.stream(**params):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                ids += chunk.token_ids
                last = chunk
            spec_s = time.perf_counter() - t0
            base_r = base.generate(**params)
        s = last.stats
        print("\n--- stats ---")
        print(f"tokens {len(ids)}  rounds {s.rounds}  drafted {s.drafted}  accepted {s.accepted}  "
              f"acceptance {s.acceptance_rate:.2f}  tokens/round {len(ids) / max(s.rounds, 1):.2f}")
        print(f"accepted per position {list(s.accepted_per_position)}")
        print(f"time: draft {s.draft_s:.2f}s  verify {s.verify_s:.2f}s (target forward {s.verify_forward_s:.2f}s)  wall {spec_s:.2f}s")
        spec_tps = len(ids) / spec_s
        base_tps = len(base_r.token_ids) / base_r.stats["wall_s"]
        same = "identical" if base_r.token_ids == ids else "DIFFERENT (bug!)"
        print(f"speculative {spec_tps:.1f} tok/s  vs  target-only {base_tps:.1f} tok/s  ->  speed-up {spec_tps / base_tps:.2f}x "
              f"(greedy outputs {same})")
        return 0 if base_r.token_ids == ids else 1
    finally:
        draft.stop()
        verify.stop()


if __name__ == "__main__":
    sys.exit(main())
