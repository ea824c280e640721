"""bench.loadtest's target-only baseline and capacity table, against real services, and the
readability of its latency plots' log axes."""
import json
import subprocess
import sys

from bench.launch import ENV, ROOT


def load(server: str, out, *extra: str) -> None:
    cmd = [sys.executable, "-m", "bench.loadtest", "--server", server, "--concurrency", "1,2", "--requests", "4",
           "--max-new-tokens", "6", "--prompts", "builtin", "--no-progress", "--out", str(out), "--append",
           "--session-tok-s", "1", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_target_only_baseline_and_capacity_side_by_side(services, tmp_path):
    v, d = services()
    load(v.address, tmp_path, "--target-only")
    load(d.address, tmp_path)
    cells = json.loads((tmp_path / "loadtest.json").read_text())["cells"]
    paths = sorted((c["tags"]["path"], c["concurrency"]) for c in cells)  # every cell names its path
    assert paths == [("speculative", 1), ("speculative", 2), ("target-only", 1), ("target-only", 2)]
    for c in cells:
        assert c["summary"]["completed"] == 4 and c["summary"]["errors"] == 0
        drafted = sum(r["drafted"] for r in c["requests"])
        assert (drafted == 0) == (c["tags"].get("path") == "target-only")  # the baseline drafts nothing
    report = (tmp_path / "REPORT.md").read_text()
    table = report[report.index("## Capacity at 1 tokens/s per session"):]
    rows = [line for line in table.splitlines()[6:] if line.startswith("|")]
    assert [r.split("|")[1].strip() for r in rows] == ["path=speculative", "path=target-only"]
    assert all(r.split("|")[2].strip() == "2" for r in rows)  # both sustain 2 sessions at 1 tok/s each


def test_latency_panels_have_several_log_ticks():
    """A panel whose latencies span less than a decade (here 30-60 ms) still has labelled ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.loadtest_report import log_y_axis

    fig, ax = plt.subplots()
    ax.plot([1, 2, 4], [30, 45, 60])
    log_y_axis(ax)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    shown = [t for t in ax.get_yticks() if lo <= t <= hi]
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert len(shown) >= 2 and "50" in labels, (shown, labels)
