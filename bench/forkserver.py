"""A fork server for starting many services quickly: `python -m bench.forkserver SOCKET`.

It imports the heavy third-party libraries once (torch, transformers, grpc: about 5 s of a
service's start-up on a small CPU), then forks a child for each request it takes on the Unix
socket SOCKET and runs the requested module there as `python -m` would, with the caller's
arguments, environment, working directory and standard streams. The children are real,
separate service processes; they only skip the imports. The tests use it (tests/conftest.py);
bench.launch sends a service here when the variable SPECDEC_FORKSERVER names the socket.

A child's environment may differ from the server's in SPECDEC_* variables only (the product's
own, read after start-up); anything else may have been read by a library at import, so such a
request is refused and the caller starts the process the usual way. Children share the server's
string-hash seed, and what the libraries printed at import is not printed again.

The server is one thread (so forking it is safe), ignores SIGINT (the caller stops it), and ends
on SIGTERM or when the process that started it ends, stopping the children it still has.

Protocol, one connection a child: the caller sends 8 bytes (the length of a JSON request, with
the child's stdin, stdout and stderr as three file descriptors), then the request {module, args,
env, cwd}. The server answers the child's pid on a line, or `refused`, and later the child's exit
status (as subprocess reports it: negative for a signal) on a second line."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys

REFUSED = "refused"


def forkable(env: dict, server_env: dict) -> bool:
    """Whether a child with environment `env` can be forked from a server started with `server_env`."""
    return all(k.startswith("SPECDEC_") for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k))


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the caller hung up")
        data += chunk
    return data


def _request(conn: socket.socket, own_env: dict) -> tuple[dict, list[int]] | None:
    """A forkable request and its three descriptors, or None (then nothing is left open but conn)."""
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        request = json.loads(_read_exactly(conn, int(head.decode())))
        if len(fds) == 3 and isinstance(request.get("env"), dict) and forkable(request["env"], own_env):
            return request, fds
    except Exception:  # noqa: BLE001 - a bad request is refused; the server goes on
        pass
    for fd in fds:
        os.close(fd)
    return None


def _serve(path: str, parent: int):
    """Serves until `parent` ends or SIGTERM; returns (request, fds) in a forked child, None in the server."""
    own_env = dict(os.environ)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    children: dict[int, socket.socket] = {}
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("ready", flush=True)
    try:
        while not stopping and os.getppid() == parent:
            readable, _, _ = select.select([srv], [], [], 0.05)
            while children:  # reap, and tell each caller its child's status
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    conn.close()
            if not readable:
                continue
            conn, _ = srv.accept()
            conn.settimeout(10)
            got = _request(conn, own_env)
            pid = None
            if got is not None:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a SIGTERM for the child waits for its own handler
                try:
                    pid = os.fork()
                except OSError:
                    pass
                if pid == 0:
                    srv.close()
                    conn.close()
                    for c in children.values():
                        c.close()
                    children.clear()  # the siblings are not this child's to stop
                    return got
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                for fd in got[1]:
                    os.close(fd)
            if pid is None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{REFUSED}\n".encode())
                conn.close()
                continue
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
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
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
    """The imports every service pays for; nothing here may start a thread (checked)."""
    import google.protobuf  # noqa: F401, PLC0415
    import grpc  # noqa: F401, PLC0415
    import grpc.aio  # noqa: F401, PLC0415
    import numpy  # noqa: F401, PLC0415
    import prometheus_client  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415
    import transformers  # noqa: F401, PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: F401, PLC0415

    for optional in ("fastapi", "uvicorn", "pydantic", "tokenizers", "safetensors.torch"):
        with contextlib.suppress(ImportError):
            __import__(optional)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        sys.exit(f"bench.forkserver: the imports started {threads - 1} thread(s); forking would copy their locks, not them")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.forkserver SOCKET")
    started_by = os.getppid()  # before the imports: a parent that ends meanwhile is noticed
    _preload()
    served = _serve(sys.argv[1], started_by)
    if served is not None:
        _run_child(*served)
