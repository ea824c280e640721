"""bench/gpu.py runs end to end on the CPU with tiny shapes (the GPU run uses the same code)."""
import json
import subprocess
import sys

from bench.launch import ENV, ROOT


def test_gpu_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, "-m", "bench.gpu", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "20",
                        "--prompt-len", "12", "--sessions", "1,3", "--out", str(out),
                        "--profile", "--repeats", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "gpu.json").read_text())
    assert res["target_only_equals_generate"] is True
    assert len(res["generate_runs_tok_s"]) == len(res["target_only_runs_tok_s"]) == 2
    assert min(res["target_only_runs_tok_s"]) <= res["target_only_tok_s"] <= max(res["target_only_runs_tok_s"])
    assert res["generate_tok_s"] > 0 and res["target_only_tok_s"] > 0
    assert set(res["speculative"]) == {"0.5", "0.8", "0.9"}
    # a forced acceptance commits the engine's own target-only tokens: the output stays generate()'s
    assert all(r["equals_generate"] and 1 <= r["tokens_per_round"] <= 5 for r in res["speculative"].values())
    # more acceptance, more tokens per round: the forced acceptance really controls alpha
    assert res["speculative"]["0.9"]["tokens_per_round"] > res["speculative"]["0.5"]["tokens_per_round"]
    assert set(res["batch"]) == {"1", "3"} and all(r["all_equal_generate"] for r in res["batch"].values())
    assert 1 <= res["batch"]["3"]["sessions_per_pass"] <= 3 and res["batch"]["1"]["sessions_per_pass"] == 1
    assert all(r["pass_ms"] > 0 and r["graph_replay_ms"] is None for r in res["batch"].values())  # no graphs on the CPU
    assert "| scheduler target-only |" in (out / "GPU.md").read_text()
    # --profile: op tables of a target-only session and a generate(), and host-side op calls per token for both
    assert "aten::mm" in (out / "profile_target_only.txt").read_text() and "aten::mm" in (out / "profile_generate.txt").read_text()
    assert res["host_ops_per_token"]["target_only"] > 0 and res["host_ops_per_token"]["generate"] > 0
    assert "generate_compiled" not in res  # the compiled baseline is on by default on cuda only


def test_varlen_probe_smoke_on_cpu(tmp_path):
    """bench/varlen_probe.py on the CPU runs only its copy of the engine's layout (gathered pages, a
    KV head's queries as one problem's rows, a mask), which must be attention: equal to the float32
    reference with keys past each session's length on the trash page; the varlen variants need CUDA."""
    p = subprocess.run([sys.executable, "-m", "bench.varlen_probe", "--sessions", "1,3", "--rows", "1,5", "--context", "40",
                        "--layers", "2", "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "varlen_probe.json").read_text())["rows"]
    assert [(r["sessions"], r["rows"], r["variant"]) for r in rows] == [(b, n, "engine") for b in (1, 3) for n in (1, 5)]
    assert all("error" not in r and r["max_abs_err"] < 1e-5 and r["us"] > 0 for r in rows)
