"""The short version of the split-topology load test (deploy/split_topology.sh): two network
namespaces joined by a veth pair, verify on one, draft + load tester on the other, 0 and 10 ms
RTT through the delaying proxy, tiny models. Skipped only where network namespaces cannot be made."""
import json
import os
import re
import subprocess
import sys

import pytest

from bench.launch import ENV, ROOT
from bench.split import netns_supported

ok, why = (False, "needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) for `ip netns add`") if os.geteuid() != 0 else netns_supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"network namespaces not available: {why}")


def test_split_topology_short_load_test(model_dir, tmp_path):
    out = tmp_path / "report"
    cmd = ["bash", os.path.join(ROOT, "deploy", "split_topology.sh"),
           "--target", model_dir("long-target"), "--draft", model_dir("long-draft"), "--rtt-ms", "0,10", "--out", str(out),
           "--", "--concurrency", "1,4", "--requests", "8", "--duration-s", "20", "--grace-s", "20",
           "--max-new-tokens", "16", "--prompts", "builtin", "--no-progress"]
    env = dict(ENV, VENV=os.path.dirname(os.path.dirname(sys.executable)))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[split] torn down" in r.stderr and "left:" not in r.stderr

    report = json.loads((out / "loadtest.json").read_text())
    cells = {(c["tags"]["rtt_ms"], c["concurrency"]): c["summary"] for c in report["cells"]}
    assert set(cells) == {(0, 1), (0, 4), (10, 1), (10, 4)}
    for key, s in cells.items():
        assert s["completed"] >= 4 and s["errors"] == 0, (key, s)
        assert s["output_tokens_per_s"] > 0 and s["acceptance_rate"] is not None
        for metric in ("ttft_s", "itl_s", "e2e_s"):
            p = s[metric]
            assert 0 < p["p50"] <= p["p95"] <= p["p99"], (key, metric, p)
        assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
    for c in (1, 4):  # the first token needs at least one draft -> verify round trip: >= the added RTT
        assert cells[(10, c)]["ttft_s"]["p50"] >= 0.010
    md = (out / "REPORT.md").read_text()
    assert "RTT 10 ms" in md and "c=4" in md and (out / "throughput_closed.png").stat().st_size > 0

    ns = re.search(r"namespaces (specdec-d-\S+) .* (specdec-v-\S+)", r.stderr).groups()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(ns) & set(listed), "namespaces left behind"
