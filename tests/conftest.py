"""Shared fixtures: tiny models on disk, and real service processes on loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tinymodels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
           TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class Service:
    """A service started as its own process with `python -m <module> ... --port 0`."""

    def __init__(self, module: str, *args: str, timeout: float = 120.0):
        self.cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING", *args]
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.address = self._wait_listening(timeout)

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("listening on "):
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return line.split()[-1]
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{self.cmd} did not start: {''.join(self.stderr)[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Tiny models: 'target' and 'draft' (different, V=16) and a V=6 pair for statistics."""
    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(name: str) -> str:
        if name not in built:
            spec = {
                "target": dict(seed=0, sharpen=4.0, eos_like=11),
                "draft": dict(seed=1, hidden=16, layers=1, sharpen=4.0),
                "stat-target": dict(vocab_size=6, seed=2, sharpen=1.5),
                "stat-draft": dict(vocab_size=6, seed=3, hidden=16, layers=1, sharpen=1.5),
                "other-vocab": dict(vocab_size=17, seed=4),
            }[name]
            built[name] = tinymodels.build(str(root / name), **spec)
        return built[name]

    return get


@pytest.fixture(scope="session")
def services(model_dir):
    """services(target, draft, *verify_args) -> (verify Service, draft Service), cached per set-up."""
    started: dict[tuple, tuple[Service, Service]] = {}

    def get(target: str = "target", draft: str = "draft", *verify_args: str):
        key = (target, draft, verify_args)
        if key not in started:
            v = Service("verify_service", "--model", model_dir(target), *verify_args)
            d = Service("draft_service", "--model", model_dir(draft), "--verify", v.address)
            started[key] = (v, d)
        return started[key]

    yield get
    for v, d in started.values():
        d.stop()
        v.stop()
