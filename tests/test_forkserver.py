"""The tests' fork server (bench/forkserver.py): a forked child runs its module as `python -m`
would, in the caller's directory, environment and streams; its exit status comes back as
subprocess reports it; an environment that differs from the server's outside SPECDEC_* (what the
preloaded libraries may have read at import) is refused, and the launcher then starts the
process the usual way."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from bench.launch import ENV, ROOT, Forked, Service, _forked


def _needs(forkserver) -> None:
    """Skips where the fork server is turned off; fails where it should run but did not start
    (the conftest warning says why): that skipped under the same reason before."""
    if forkserver is None:
        if os.environ.get("SPECDEC_FORKSERVER") == "0":
            pytest.skip("SPECDEC_FORKSERVER=0")
        pytest.fail("the fork server did not start (the session's warning has its log)")


def _cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def test_a_forked_child_reports_its_output_and_exit_status(forkserver):
    _needs(forkserver)
    p = _forked(forkserver, _cmd("bench.forkserver"), dict(ENV, SPECDEC_PROBE="seen"))  # no socket argument: a usage error
    assert isinstance(p, Forked) and p.pid != os.getpid()
    assert p.wait(60) == 1
    assert "usage: python -m bench.forkserver SOCKET" in p.stderr.read()


def test_a_signal_is_reported_as_subprocess_reports_it(forkserver):
    _needs(forkserver)
    p = _forked(forkserver, _cmd("http.server", "0", "--bind", "127.0.0.1"), ENV)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.kill()
    assert p.wait(30) == -signal.SIGKILL and p.poll() == -signal.SIGKILL
    p.kill()  # after the end: nothing to signal, no error


def test_an_environment_read_at_import_is_refused_and_started_the_usual_way(forkserver, model_dir):
    _needs(forkserver)
    other = dict(ENV, OMP_NUM_THREADS=str(int(ENV.get("OMP_NUM_THREADS", "1")) + 1))  # read by libgomp when torch loads
    assert _forked(forkserver, _cmd("http.server"), other) is None
    v = Service("verify_service", "--model", model_dir("target"), env=other)
    try:
        assert isinstance(v.proc, subprocess.Popen)
    finally:
        assert v.stop() in (0, -signal.SIGTERM)
    f = Service("verify_service", "--model", model_dir("target"), env=dict(ENV, SPECDEC_PROBE="any"))
    try:
        assert isinstance(f.proc, Forked) and f.address
    finally:
        assert f.stop() in (0, -signal.SIGTERM)


def test_the_child_runs_in_the_callers_environment_and_directory(forkserver, tmp_path):
    _needs(forkserver)
    check = f"import os; assert os.environ.get('SPECDEC_PROBE') == 'seen' and os.getcwd() == {str(tmp_path)!r}, 'not the caller'"
    seen = _forked(forkserver, _cmd("timeit", "-n", "1", "-r", "1", check), dict(ENV, SPECDEC_PROBE="seen"), cwd=str(tmp_path))
    assert seen.wait(60) == 0, seen.stderr.read()
    for env, cwd in ((ENV, str(tmp_path)), (dict(ENV, SPECDEC_PROBE="seen"), ROOT)):
        unseen = _forked(forkserver, _cmd("timeit", "-n", "1", "-r", "1", check), env, cwd=cwd)
        assert unseen.wait(60) == 1 and "not the caller" in unseen.stderr.read()


def test_bad_callers_do_not_end_the_server_and_its_end_stops_its_children(tmp_path):
    """A server of the test's own: junk and a caller that hangs up mid-request are refused and
    the server goes on; when it is stopped, its children are stopped too (their status lost)."""
    path = str(tmp_path / "s.sock")
    server = subprocess.Popen([sys.executable, "-m", "bench.forkserver", path], cwd=ROOT, env=ENV,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        for junk in (b"not a length", b"00000005{}"):
            with socket.socket(socket.AF_UNIX) as c:
                c.connect(path)
                c.sendall(junk)
                c.shutdown(socket.SHUT_WR)
                assert c.recv(64) == b"refused\n"
        child = _forked(path, _cmd("http.server", "0", "--bind", "127.0.0.1"), ENV)
        assert child is not None and child.poll() is None
        server.terminate()
        assert server.wait(30) == 0 and child.wait(30) == Forked.LOST
        assert not os.path.exists(f"/proc/{child.pid}")
    finally:
        server.kill()
