"""A fork server for starting many services quickly: `python -m bench.forkserver SOCKET`.

It imports the heavy third-party libraries once (torch, transformers, grpc: about 5 s of a
service's start-up on a small CPU), then forks a child for each request it takes on the Unix
socket SOCKET and runs the requested module there as `python -m` would, with the caller's
arguments, environment, working directory and standard streams. The children are real,
separate service processes; they only skip the imports. The tests use it (tests/conftest.py);
bench.launch sends a service here when the variable SPECDEC_FORKSERVER names the socket and the
service's environment differs from the server's only in variables read after start-up.

The server is one thread (so forking it is safe) and ends when its parent does, or on SIGTERM.

Protocol, one connection a child: the caller sends 8 bytes (the length of a JSON request, with
the child's stdin, stdout and stderr as three file descriptors), then the request {module, args,
env, cwd}. The server answers the child's pid on a line (or `refused`,
when the environment is not `forkable`), and later its exit status (as
subprocess reports it: negative for a signal) on a second line."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys

# variables that the libraries imported here read at import: a child that needs other values starts the usual way
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA", "NVIDIA_", "HF_", "HUGGINGFACE_",
                  "TRANSFORMERS_", "TOKENIZERS_", "GRPC_", "PYTHON", "LD_", "TMPDIR")


def forkable(env: dict, server_env: dict) -> bool:
    """Whether a child with environment `env` can be forked from a server started with `server_env`."""
    changed = {k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k)}
    return not any(k.startswith(READ_AT_IMPORT) for k in changed)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the caller hung up")
        data += chunk
    return data


def _serve(path: str):
    """Serves until the parent ends; returns (request, fds) in a forked child, None in the server."""
    parent = os.getppid()
    own_env = dict(os.environ)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    children: dict[int, socket.socket] = {}
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print("ready", flush=True)
    try:
        while not stopping and os.getppid() == parent:
            readable, _, _ = select.select([srv], [], [], 0.05)
            while children:  # reap, and tell each caller its child's status
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
            if not readable:
                continue
            conn, _ = srv.accept()
            conn.settimeout(10)
            fds: list[int] = []
            try:
                head, fds, _, _ = socket.recv_fds(conn, 8, 3)
                request = json.loads(_read_exactly(conn, int(head.decode())))
                if len(fds) != 3 or not forkable(request["env"], own_env):
                    raise ValueError("not forkable")
            except (OSError, ValueError, KeyError, TypeError):
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(b"refused\n")  # the caller starts it the usual way
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                for c in children.values():
                    c.close()
                children.clear()  # the siblings are not this child's to stop
                return request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            with contextlib.suppress(OSError):  # a caller gone: its child is reaped all the same
                conn.sendall(f"{pid}\n".encode())
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    return None


def _run_child(request: dict, fds: list[int]) -> None:
    """In the child: becomes `python -m MODULE ARGS...` in the caller's environment and directory."""
    import runpy  # noqa: PLC0415

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):  # (0, 1, 2 are open in the server, so no fd received is one of them)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _preload() -> None:
    """The imports every service pays for; nothing here may start a thread."""
    import google.protobuf  # noqa: F401, PLC0415
    import grpc  # noqa: F401, PLC0415
    import grpc.aio  # noqa: F401, PLC0415
    import numpy  # noqa: F401, PLC0415
    import prometheus_client  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415
    import transformers  # noqa: F401, PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: F401, PLC0415

    for optional in ("fastapi", "uvicorn", "pydantic", "tokenizers", "safetensors.torch"):
        try:
            __import__(optional)
        except ImportError:
            pass


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.forkserver SOCKET")
    _preload()
    served = _serve(sys.argv[1])
    if served is not None:
        _run_child(*served)
