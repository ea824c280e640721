"""bench/run.py end to end on the shipped pair, cut short: one prompt, a few tokens, no RTT emulation."""
import json
import subprocess
import sys

from bench.launch import ENV, ROOT


def test_bench_run_measures_the_services_and_generate_in_one_dtype(tmp_path):
    """The in-process anchors run in the services' dtype (they once ran float32 beside bf16
    services): in float32 the services' greedy tokens are transformers' generate() tokens. (The
    services' CPU engine choices are pinned: timing them costs the shipped target half a minute of
    start-up here, and any choice is exact.)"""
    env = dict(ENV, SPECDEC_ENGINE_CHOICES="fp32-prepack=off,per-row=off")
    p = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--prompts", "1", "--max-new-tokens", "12", "--rtt-ms", "",
                        "--dtype", "float32", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["dtype"] == "float32"
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["target-only"]["tokens"] == 12 and rows["hf generate"]["tokens"] == 12
    assert rows["hf generate"]["exact"] == "yes" and rows["spec tau=4"]["exact"] == "yes"
    assert "every model in float32" in (tmp_path / "REPORT.md").read_text()


def test_bench_passes_times_uniform_and_mixed_passes(tmp_path):
    """bench.passes on its tiny target: passes of N sessions' rounds, and mixed layouts (target-only
    steps beside rounds of several proposals) whose rounds all shared a pass."""
    for args in (["--sessions", "1,2", "--repeats", "2"], ["--mixed", "2x0+1x3,1x1", "--repeats", "2", "--idle-ms", "0,3"]):
        p = subprocess.run([sys.executable, "-m", "bench.passes", *args, "--out", str(tmp_path)], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    uniform = json.loads((tmp_path / "passes.json").read_text())["rows"]
    assert [r["sessions"] for r in uniform] == [1, 2] and all(r["median_ms"] > 0 for r in uniform)
    mixed = json.loads((tmp_path / "passes_mixed.json").read_text())["rows"]
    assert [(r["layout"], r["idle_ms"], r["sessions"], r["rows"]) for r in mixed] == \
        [("2x0+1x3", 0, 3, 6), ("2x0+1x3", 3, 3, 6), ("1x1", 0, 1, 2), ("1x1", 3, 1, 2)]
    assert all(r["passes"] >= 1 and r["median_ms"] > 0 for r in mixed)
    assert "| 2x0+1x3 | 3 | 3 | 6 |" in (tmp_path / "PASSES_MIXED.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "bench.passes", "--mixed", "1x1", "--idle-ms", "4,x", "--out", str(tmp_path)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--idle-ms" in bad.stderr.strip().splitlines()[-1], bad.stderr
