"""`make demo` (bench.demo), the README's first command, on tiny models: it runs through and
says speculative == target-only == generate(); a service that does not start is one line and
exit code 2, with no service left running."""
import os
import subprocess
import sys

from bench.launch import ENV, ROOT
from bench.demo import tiny_pair


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.demo", "--max-new-tokens", "24", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def left_running(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if marker in line and ("verify_service" in line or "draft_service" in line)]


def test_the_demo_runs_and_its_outputs_agree(tmp_path):
    target, draft = tiny_pair(str(tmp_path))
    p = demo("--target", target, "--draft", draft)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "greedy speculative == target-only == generate()" in p.stdout and "the same text" in p.stdout, p.stdout[-2000:]
    assert not left_running(str(tmp_path))


def test_a_draft_that_does_not_start_leaves_no_verify_service_behind(tmp_path):
    """From a review: the verify service started first and was stopped only inside the try that
    followed the draft's start, so a draft that failed to start left it running (parent 1) and
    printed a traceback."""
    target, _ = tiny_pair(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    p = demo("--target", target, "--draft", str(broken))
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("[demo] a service did not start: python -m draft_service: error: --model"), lines
    assert "Traceback" not in p.stderr
    assert not left_running(str(tmp_path))
