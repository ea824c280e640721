"""Starts specdec services as their own processes through their real command lines, and reads
the `listening on HOST:PORT` line they print (and the `metrics on` and `http on` lines before it).

Used by the demo, the benchmarks and the tests (tests may import bench; bench never imports
tests). It needs a checkout of the repository: services start with `python -m` from its root.
Where SPECDEC_FORKSERVER names a fork server's socket (bench.forkserver; the tests start one),
a service is forked from it instead, the same command line without the imports; with a command
prefix (such as `ip netns exec`), or where the server is gone or refuses (an environment it cannot
fork for), it starts the usual way."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
           HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
ENV.setdefault("OMP_NUM_THREADS", "1")


class StartFailed(RuntimeError):
    """A service that ended (or never said `listening on`) before it served; `stderr`: all it wrote there."""

    def __init__(self, cmd, stderr: str):
        super().__init__(f"{cmd} did not start: {stderr[-3000:]}")
        self.stderr = stderr

    def last_line(self) -> str:
        """The service's own one-line reason (startup.main writes it last), or the message."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else str(self)


class Service:
    """A service started as its own process with `python -m <module> ... --port PORT` (0: a free
    port, which it prints); `wait=False` returns at once, and `wait()` waits for it to listen."""

    def __init__(self, module: str, *args: str, timeout: float = 120.0, host: str = "127.0.0.1", env: dict | None = None,
                 prefix: tuple[str, ...] = (), port: int = 0, wait: bool = True):
        self.cmd = [*prefix, sys.executable, "-m", module, "--host", host, "--port", str(port), "--log-level", "WARNING", *args]
        env = env or ENV
        self.proc = (not prefix and _forked(env.get("SPECDEC_FORKSERVER"), self.cmd, env)
                     or subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        self.stderr: list[str] = []
        self.metrics_address: str | None = None
        self.http_address: str | None = None  # the draft's OpenAI-compatible API, with --http-port
        self.timeout = timeout
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self._stdout: queue.Queue = queue.Queue()  # its stdout's lines, then None at its end: read with a deadline
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        self.address: str | None = None
        if wait:
            self.wait()

    def wait(self) -> None:
        """Waits for `listening on` (a Service made with wait=False); RuntimeError if the process ends first."""
        if self.address is None:
            self.address = self._wait_listening(self.timeout)

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _drain_stdout(self):
        for line in self.proc.stdout:
            self._stdout.put(line)
        self._stdout.put(None)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:  # a process that lives on without printing is waited for until the deadline, not forever
                line = self._stdout.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:  # it ended
                break
            if line.startswith("metrics on "):
                self.metrics_address = line.split()[-1]
            if line.startswith("http on "):
                self.http_address = line.split()[-1]
            if line.startswith("listening on "):
                return line.split()[-1]
        self.stop()
        raise StartFailed(self.cmd, "".join(self.stderr))

    def metrics(self) -> str:
        """The Prometheus exposition text, scraped over HTTP."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode()

    def cpu_s(self) -> float:
        """CPU seconds the process has used so far (user + system, from /proc; Linux only)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Forked:
    """A child of the fork server (bench.forkserver), with the parts of subprocess.Popen that
    Service and its users call: pid, stdout, stderr (text), poll, wait, send_signal, kill,
    terminate and returncode. Should the server end before it reports a child's status, the
    child is waited for by its pid and its returncode is LOST."""

    LOST = -255

    def __init__(self, conn: socket.socket, pid: int, cmd: list[str], stdout: int, stderr: int, buf: bytearray):
        self._conn, self.pid, self.args, self._buf = conn, pid, cmd, buf
        self.returncode: int | None = None
        self.stdout, self.stderr = open(stdout, errors="replace"), open(stderr, errors="replace")

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            line = _next_line(self._conn, self._buf, timeout, self.args)
            if line is None:  # the server ended: the child's status went with it
                while os.path.exists(f"/proc/{self.pid}"):
                    if deadline is not None and time.monotonic() >= deadline:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                    time.sleep(0.05)
                self.returncode = self.LOST
            else:
                self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _next_line(conn: socket.socket, buf: bytearray, timeout: float | None, cmd) -> str | None:
    """The next line from the fork server, taken from `buf` (which keeps what it has read past
    it, and what it has read of a line when it times out); None once the server has hung up.
    TimeoutExpired after `timeout` seconds without a whole line."""
    conn.settimeout(timeout)
    while b"\n" not in buf:
        try:
            chunk = conn.recv(64)
        except (TimeoutError, BlockingIOError):
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\n")
    line = buf[:end].decode()
    del buf[: end + 1]
    return line


def _forked(server: str | None, cmd: list[str], env: dict, cwd: str = ROOT) -> Forked | None:
    """`cmd` (`python -m MODULE ARGS...`) started by the fork server listening on the Unix socket
    `server` (a path; unset or "0": none); None where there is none, it is gone, or it refuses."""
    if not server or server == "0":
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request = json.dumps({"module": cmd[2], "args": cmd[3:], "env": env, "cwd": cwd}).encode()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        conn.settimeout(30)
        conn.connect(server)
        socket.send_fds(conn, [f"{len(request):08d}".encode()], [null, out_w, err_w])
        conn.sendall(request)
        rest = bytearray()
        answer = _next_line(conn, rest, 30.0, cmd)  # the pid, or `refused`
        pid = int(answer) if answer and answer.isdigit() else None
    except (OSError, subprocess.TimeoutExpired):  # no server there, or one that does not answer
        pid = None
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    if pid is None:
        for fd in (out_r, err_r):
            os.close(fd)
        conn.close()
        return None
    return Forked(conn, pid, cmd, out_r, err_r, rest)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now; another process may bind it before the caller does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_pair(verify_args: tuple[str, ...], draft_args: tuple[str, ...], env: dict | None = None,
               draft_env: dict | None = None, attempts: int = 3) -> tuple[Service, Service]:
    """A verify service and a draft service pointed at it, started side by side rather than one
    after the other: the verify's port is picked here, and the draft waits for it to serve
    (--verify-wait-s; `draft_args` may set its own). A port taken in between fails the verify's
    start (the services bind with SO_REUSEPORT off) and the pair starts again on another port."""
    port = free_port()
    v = Service("verify_service", *verify_args, port=port, env=env, wait=False)
    d = Service("draft_service", "--verify", f"127.0.0.1:{port}", "--verify-wait-s", "120", *draft_args,
                env=draft_env or env, wait=False)
    try:
        v.wait()
    except BaseException as e:
        d.stop()
        if isinstance(e, StartFailed) and "in use" in e.stderr and attempts > 1:
            return start_pair(verify_args, draft_args, env, draft_env, attempts - 1)
        raise
    try:
        d.wait()
    except BaseException:
        v.stop()
        raise
    return v, d


@contextlib.contextmanager
def service_pair(target: str, draft: str, *args: str):
    """A verify service on the model directory `target` and a draft service on `draft` pointed
    at it, both with a metrics port and `args`, started side by side (start_pair); yields
    (verify, draft) and stops both after."""
    v, d = start_pair(("--model", target, "--metrics-port", "0", *args), ("--model", draft, "--metrics-port", "0", *args))
    try:
        yield v, d
    finally:
        d.stop()
        v.stop()
