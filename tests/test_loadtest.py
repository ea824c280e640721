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
    for r in rows:  # the sessions sustained are what the cells measured, not a speed this test expects
        path = r.split("|")[1].strip().removeprefix("path=")
        met = [c["concurrency"] for c in cells if c["tags"]["path"] == path
               and c["summary"]["output_tokens_per_s"] / c["concurrency"] >= 1]
        assert r.split("|")[2].strip() == (str(max(met)) if met else "none")


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


def test_baseline_alternates_with_the_speculative_path(services, tmp_path):
    """--baseline runs each cell against the verify service too, target-only, in the same process,
    alternating which path goes first by run; the report divides each run's pair."""
    v, d = services()
    load(d.address, tmp_path, "--baseline", v.address, "--repeats", "2")
    cells = json.loads((tmp_path / "loadtest.json").read_text())["cells"]
    seen = sorted((c["concurrency"], c["run"], c["tags"]["path"], c["order"]) for c in cells)
    assert seen == [(1, 1, "speculative", 1), (1, 1, "target-only", 2), (1, 2, "speculative", 2), (1, 2, "target-only", 1),
                    (2, 1, "speculative", 1), (2, 1, "target-only", 2), (2, 2, "speculative", 2), (2, 2, "target-only", 1)]
    for c in cells:
        assert c["summary"]["completed"] == 4 and c["summary"]["errors"] == 0
        assert (sum(r["drafted"] for r in c["requests"]) == 0) == (c["tags"]["path"] == "target-only")
    report = (tmp_path / "REPORT.md").read_text()
    table = report[report.index("## Speculative over target-only, run by run"):].split("\n\n")[2].splitlines()[2:]
    assert len(table) == 2
    tok = {(c["concurrency"], c["run"], c["tags"]["path"]): c["summary"]["output_tokens_per_s"] for c in cells}
    for row, level in zip(table, (1, 2)):
        cols = [x.strip() for x in row.split("|")[1:-1]]
        assert cols[:3] == ["path=speculative", f"c={level}", "2"]
        want = [tok[level, r, "speculative"] / tok[level, r, "target-only"] for r in (1, 2)]
        assert cols[5] == " / ".join(f"{x:.2f}" for x in want)
        assert cols[6] == f"**{sum(want) / 2:.2f}×**"
    assert "c=2, run 2" in report  # every run's cell is listed
    load(d.address, tmp_path / "odd", "--baseline", v.address)  # one run a level: the alternation goes on across levels
    cells = json.loads((tmp_path / "odd" / "loadtest.json").read_text())["cells"]
    assert sorted((c["concurrency"], c["tags"]["path"], c["order"]) for c in cells) == [
        (1, "speculative", 1), (1, "target-only", 2), (2, "speculative", 2), (2, "target-only", 1)]
    # a level at a time, as bench.split interleaves RTTs: the offset carries the alternation across invocations
    load(d.address, tmp_path / "offset", "--baseline", v.address, "--pair-offset", "1")
    cells = json.loads((tmp_path / "offset" / "loadtest.json").read_text())["cells"]
    assert sorted((c["concurrency"], c["tags"]["path"], c["order"]) for c in cells) == [
        (1, "speculative", 2), (1, "target-only", 1), (2, "speculative", 1), (2, "target-only", 2)]


def test_an_address_that_does_not_serve_its_path_is_one_line(services, tmp_path):
    """A --baseline that is not a verify service (here the draft service), or a --server nobody
    listens on, ends the load test before any cell with one line naming the flag and the address."""
    v, d = services()
    for argv, flag, address, code in ((["--server", d.address, "--baseline", d.address], "--baseline", d.address, "UNIMPLEMENTED"),
                                      (["--server", "127.0.0.1:1"], "--server", "127.0.0.1:1", "UNAVAILABLE")):
        r = subprocess.run([sys.executable, "-m", "bench.loadtest", *argv, "--concurrency", "1", "--requests", "1", "--prompts", "builtin",
                            "--no-progress", "--timeout-s", "20", "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"bench.loadtest: {flag} {address}: {code}: "), last
        assert not (tmp_path / "loadtest.json").exists()


def test_baseline_options_are_checked(capsys):
    from bench.loadtest import main

    for argv, words in ((["--target-only", "--baseline", "127.0.0.1:1"], "not with --target-only"),
                        (["--baseline", "127.0.0.1:1", "--tag", "path=x"], "no --tag path=... with it"),
                        (["--repeats", "0"], "--repeats must be at least 1")):
        try:
            main(["--server", "127.0.0.1:1", "--concurrency", "1", *argv])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert words in capsys.readouterr().err


def test_typical_cell_is_the_median_run():
    from bench.loadtest_report import typical

    def cell(run, tok_s, path="speculative"):
        return {"mode": "closed", "concurrency": 4, "rate": None, "tags": {"path": path}, "run": run,
                "summary": {"output_tokens_per_s": tok_s}}

    cells = [cell(1, 30.0), cell(2, 10.0), cell(3, 20.0), cell(1, 5.0, "target-only"), cell(2, 7.0, "target-only")]
    got = sorted((c["tags"]["path"], c["run"]) for c in typical(cells))
    assert got == [("speculative", 3), ("target-only", 1)]  # the median of three; the lower middle of two


def _cell(run, tok_s, path="speculative", mode="closed", level=4, e2e=1.0, **tags):
    return {"mode": mode, "concurrency": level if mode == "closed" else None, "rate": level if mode == "open" else None,
            "tags": {"path": path, **tags}, "run": run,
            "summary": {"output_tokens_per_s": tok_s, "completed": 1, "e2e_s": {"p50": e2e}}}


def test_paired_ratios_take_the_median_run_by_run():
    """Three runs: the median ratio is the middle one (not the mean); open-loop cells are not
    paired (their tok/s is about the offered rate); cells tagged apart (rtt_ms) are paired apart."""
    from bench.loadtest_report import paired, typical

    cells = [_cell(1, 100.0), _cell(1, 50.0, "target-only"),  # 2.0
             _cell(2, 90.0), _cell(2, 100.0, "target-only"),  # 0.9
             _cell(3, 110.0), _cell(3, 100.0, "target-only"),  # 1.1
             _cell(1, 5.0, mode="open", level=2), _cell(1, 5.0, "target-only", mode="open", level=2),
             _cell(1, 30.0, rtt_ms=10), _cell(1, 20.0, "target-only", rtt_ms=10)]
    rows = [r for r in paired(cells) if r.startswith("| ") and "path / tags" not in r]
    assert len(rows) == 2, rows
    cols = {r.split("|")[1].strip(): [x.strip() for x in r.split("|")[1:-1]] for r in rows}
    assert cols["path=speculative"][5:] == ["2.00 / 0.90 / 1.10", "**1.10×**"]
    assert cols["RTT 10 ms"][5:] == ["1.50", "**1.50×**"]
    got = {(c["tags"]["path"], c["tags"].get("rtt_ms"), c["mode"]) for c in typical(cells)}
    assert got == {(p, r, m) for p in ("speculative", "target-only") for r, m in ((None, "closed"), (None, "open"), (10, "closed"))}


def test_append_replaces_every_run_of_a_level():
    from bench.loadtest import _same_cell

    assert _same_cell(_cell(3, 1.0), _cell(1, 2.0))  # a new run 1 replaces an old run 3 of the same level and tags
    assert not _same_cell(_cell(1, 1.0), _cell(1, 1.0, "target-only"))
    assert not _same_cell(_cell(1, 1.0), _cell(1, 1.0, level=16))


def test_goodput_ratios_pair_each_repeat_with_its_own_baseline():
    """From a review: bench.goodput divided the median speculative run by the median target-only
    run, which may come from another repeat (the machine drifts between repeats); a ratio is the
    median of the repeats' own ratios, as bench.loadtest's paired() takes it."""
    from bench.goodput import paired_ratio

    fast_then_slow = [{"tok_s": 200.0}, {"tok_s": 100.0}, {"tok_s": 104.0}]  # the machine slowed after the first repeat
    baseline = [{"tok_s": 100.0}, {"tok_s": 100.0}, {"tok_s": 80.0}]
    assert paired_ratio(fast_then_slow, baseline) == 1.3  # the repeats' 2.0, 1.0 and 1.3; the medians' ratio was 1.04
    assert paired_ratio([{"tok_s": 3.0}], [{"tok_s": 2.0}]) == 1.5


def test_a_level_whose_requests_outlived_the_run_is_not_sustained():
    """From a review: a level whose slowest requests were cancelled at the run's deadline met the
    ITL target and the per-session rate on the requests that finished: the sizing's c* and the
    capacity table counted it. A level with cancelled requests sustains nothing."""
    from bench.loadtest_report import capacity, sizing

    def cell(level, tok_s, cancelled, path="speculative"):
        c = _cell(1, tok_s, path, level=level)
        c["summary"].update(errors=0, cancelled_at_deadline=cancelled, itl_s={"p95": 0.05}, draft_ms_per_token=1.0,
                            verify_forward_ms_per_token=5.0)
        return c

    cells = [cell(1, 20.0, 0), cell(16, 160.0, 6), cell(1, 15.0, 0, "target-only"), cell(16, 150.0, 0, "target-only")]
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in capacity(cells, 5.0) if r.startswith("| path=")}
    assert rows == {"path=speculative": "1", "path=target-only": "16"}
    rows = {r.split("|")[1].strip(): [x.strip() for x in r.split("|")[2:-1]] for r in sizing(cells, 100.0) if r.startswith("| path=")}
    assert rows["path=speculative"][0] == "1" and rows["path=target-only"][0] == "16", rows
    assert rows["path=speculative"][-2:] == ["100.0", "0.01"]  # 100 ms of ITL over 1 ms of drafting a token; 1 session
    cells[2]["summary"]["draft_ms_per_token"] = cells[3]["summary"]["draft_ms_per_token"] = 0.0  # target-only drafts nothing
    rows = {r.split("|")[1].strip(): [x.strip() for x in r.split("|")[2:-1]] for r in sizing(cells, 100.0) if r.startswith("| path=")}
    assert rows["path=target-only"][-2:] == ["–", "–"]  # no draft cores to size (it printed inf and 0.00)


def test_bad_credentials_are_one_line_before_any_cell(tmp_path):
    """From a review: a token a header cannot carry, or a certificate and key that are not one
    pair, gave a traceback from inside the first cell; they are one line, exit 2, as the CLI's."""
    import subprocess
    import sys

    from bench.launch import ENV, ROOT

    key = tmp_path / "a.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(tmp_path / "a.pem"), "-subj", "/CN=a", "-days", "1"], check=True, capture_output=True)
    for extra, says in ((["--token", "hunter\u00e92"], "printable ASCII"),
                        (["--tls-cert", str(key), "--tls-key", str(tmp_path / "a.pem")], "not a certificate and its private key"),
                        # from a review: the baseline's own TLS file was named --tls-ca, and without --baseline it was dropped
                        (["--baseline", "127.0.0.1:2", "--fallback-tls-ca", str(key)], f"--fallback-tls-ca {key}: "),
                        (["--fallback-tls-ca", str(tmp_path / "a.pem")], "--fallback-tls-ca without --baseline")):
        p = subprocess.run([sys.executable, "-m", "bench.loadtest", "--server", "127.0.0.1:1", "--concurrency", "1", *extra],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and says in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr and "hunter" not in p.stderr, p.stderr
