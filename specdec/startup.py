"""Start-up of both services, in one place: the command line and what a failed start looks like.

A service either serves or says why in one line: `main(prog, fn)` runs a service's start-up and
turns a `StartupError` (a bad flag value, an unreadable file, a model that cannot be loaded, a
port in use, a verify service that refuses the session token) into one stderr line,
`PROG: error: ...`, naming the flag or file and the reason, and exit code 2, with no traceback.
`Parser` does the same for argparse's own errors (no usage block), and `number` checks numeric
flag values where they are parsed.

This module imports nothing heavy, so a bad flag or token file is refused before torch loads."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import signal
import socket
import sys

from specdec.choices import parse_choices
from specdec.files import StartupError, check_ca, check_pair, read_file, read_pem  # noqa: F401 - the services import them from here


class _Defaults(argparse.HelpFormatter):
    """Help that ends with a flag's default where it has a value and the text does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or any(action.default is d for d in (None, False, argparse.SUPPRESS))  # `is`: 0 is a default to show
                or not action.option_strings or action.nargs == 0):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Defaults)
        super().__init__(*args, **kwargs)
        self.switches: dict[str, str] = {}  # a switch's dest -> its environment variable (add_switch)

    def error(self, message: str):  # argparse prints its usage block first: one line instead
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, and what it leaves unchecked: a choice whose default came from the environment
        (SPECDEC_*), one port for two listeners, and TLS files that only work in pairs."""
        ns = super().parse_args(args, namespace)
        for a in self._actions:
            v = getattr(ns, a.dest, None)
            if a.choices is not None and v is not None and v not in a.choices:
                self.error(f"{a.option_strings[-1]} {v!r} (from the environment): choose from {', '.join(map(str, a.choices))}")
            if a.dest in self.switches and isinstance(v, str):  # env_flag's unread word
                self.error(f"{self.switches[a.dest]}={v!r}: not a switch value (use {'/'.join(TRUE)} or {'/'.join(FALSE)})")
        ports = [(f"--{k.replace('_', '-')}", getattr(ns, k)) for k in ("port", "metrics_port", "http_port") if getattr(ns, k, None)]
        for i, (flag, port) in enumerate(ports):
            other = next((f for f, q in ports[:i] if q == port), None)
            if other:
                self.error(f"{flag} {port}: the same port as {other}")
        for pre in ("tls", "verify-tls"):  # a certificate and its key go together
            cert, key = (getattr(ns, f"{pre.replace('-', '_')}_{part}", None) for part in ("cert", "key"))
            if bool(cert) != bool(key):
                self.error(f"--{pre}-cert needs --{pre}-key" if cert else f"--{pre}-key needs --{pre}-cert")
        if getattr(ns, "tls_client_ca", None) and not getattr(ns, "tls_cert", None):  # clients are checked over TLS only
            self.error("--tls-client-ca needs --tls-cert and --tls-key (clients' certificates are checked over TLS)")
        return ns


def number(kind=int, low: float | None = None, above: float | None = None, high: float | None = None):
    """An argparse type: `kind` (int or float), finite, >= low / > above / <= high."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        if above is not None and v <= above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return v
    return parse


PORT = number(int, low=0, high=65535)


def or_auto(parse):
    """An argparse type: `parse`'s, or "auto" for None (the default the service works out)."""
    def parse_or_auto(text: str):
        if text == "auto":
            return None
        try:
            return parse(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or auto)") from None
    return parse_or_auto


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # one of them: a tokenizer transformers can load


def check_server_args(p: argparse.ArgumentParser, args) -> None:
    """The server flags that only mean something together (add_server_args): a usage error otherwise."""
    if args.max_connection_age_grace_s is not None and not args.max_connection_age_s:
        p.error("--max-connection-age-grace-s bounds streams on connections past --max-connection-age-s: give that too")


def check_files(args, *names: str) -> None:
    """Each file flag that is set (args.<name>, e.g. tls_cert: PEM certificates and keys) names a
    readable PEM file (an empty or other file failed later, inside gRPC, blaming --port or not at all)."""
    for name in names:
        path = getattr(args, name, None)
        if path:
            read_pem(path, "--" + name.replace("_", "-"))
    for name in ("tls_client_ca", "verify_tls_ca"):  # a CA bundle must hold a certificate: a key there went
        path = getattr(args, name, None)  # through to gRPC (a server that failed to start blaming --port, a draft never serving)
        if path and name in names:
            check_ca(path, "--" + name.replace("_", "-"))
    for pre in ("tls", "verify_tls"):  # a certificate and its key that are not one pair: gRPC's own refusal came after the
        cert, key = getattr(args, f"{pre}_cert", None), getattr(args, f"{pre}_key", None)  # model load, behind its log lines
        if cert and key and f"{pre}_cert" in names:
            flag = "--" + pre.replace("_", "-")
            check_pair(cert, key, f"{flag}-cert", f"{flag}-key")


def check_model_dir(path: str, flag: str = "--model") -> None:
    """What --model must hold, checked before the model libraries load: a directory with a
    config.json that is a JSON object, weights (*.safetensors / *.bin, or their index), and
    tokenizer files. What these checks pass, loading checks again (specdec/lm.py)."""
    if not os.path.isdir(path):
        raise StartupError(f"{flag} {path}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    names = os.listdir(path)
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            ok = isinstance(json.load(f), dict)
    except OSError as e:
        raise StartupError(f"{flag} {path}: config.json: {e.strerror or e}") from None
    except ValueError as e:
        raise StartupError(f"{flag} {path}: config.json is not valid JSON: {e}") from None
    if not ok:
        raise StartupError(f"{flag} {path}: config.json is not a JSON object")
    if not any(n.endswith((".safetensors", ".bin", ".index.json")) for n in names):
        raise StartupError(f"{flag} {path}: no weights (model.safetensors, pytorch_model.bin or a sharded index)")
    if not any(n in TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names):
        raise StartupError(f"{flag} {path}: no tokenizer files (such as {', '.join(TOKENIZER_FILES)}); "
                           "the services need the model's tokenizer")


def check_port(host: str, port: int | None, flag: str) -> None:
    """StartupError if `port` cannot be bound on `host` now (in use: by anyone, SO_REUSEPORT or
    not). Checked before the model loads; the servers bind for real later (gRPC with
    SO_REUSEPORT off), and fail the same way if the port was taken in between. Port 0 (any free
    port) checks the host: one that is not this machine's was found only after the model loaded."""
    if port is None:
        return
    try:
        addrs = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise StartupError(f"--host {host}: {e.strerror or e}") from None
    errors = []
    for family, kind, proto, _, addr in addrs:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: a restart's TIME_WAIT is no conflict
                s.bind(addr)
        except OSError as e:
            errors.append(e)
    # in use on any address is an error; others (no IPv6 for `localhost`) only if no address binds, as for gRPC
    bad = [e for e in errors if e.errno == errno.EADDRINUSE] or (errors if len(errors) == len(addrs) else [])
    if bad:
        if bad[0].errno == errno.EADDRNOTAVAIL:  # the host is not this machine's: --host is at fault, not the port
            raise StartupError(f"--host {host}: not an address of this machine ({bad[0].strerror or bad[0]})")
        raise StartupError(f"{flag} {port}: cannot listen on {host}:{port}: {bad[0].strerror or bad[0]}")


class _Stopped(SystemExit):
    """SIGTERM before the service serves (a SystemExit: asyncio passes it out of a callback, where
    another exception would be logged and dropped)."""


def _stop(signum, frame):
    raise _Stopped(signum)


def main(prog: str, fn) -> None:
    """Runs a service's start-up `fn()`; a StartupError ends the process with one line and exit 2.
    SIGTERM before it serves (a pod deleted while it loads its model) ends it with one line and
    exit 143: as a container's PID 1 a process without a handler ignores SIGTERM, and would load
    and serve until the kubelet's kill. Once serving, serving.serve takes SIGTERM over (the drain)."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C while the model loads: one line too, not a traceback
        signal.signal(sig, _stop)
    try:
        fn()
    except StartupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except _Stopped as e:
        sig = signal.Signals(e.code)
        print(f"{prog}: stopped by {sig.name} before serving", file=sys.stderr, flush=True)
        sys.exit(128 + sig)


def env(name: str) -> str | None:
    """An environment variable as a flag default (unset or empty: None)."""
    return os.environ.get(name) or None


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool | str:
    """A boolean environment variable as a flag default: 1/true/yes/on or 0/false/no/off (any case);
    anything else is returned as it is, for Parser.parse_args to refuse (`disabled` read as on)."""
    v = env(name)
    if v is None:
        return default
    word = v.strip().lower()
    return True if word in TRUE else False if word in FALSE else v


def add_switch(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """--NAME / --no-NAME, its default from SPECDEC_NAME (env_flag) and `default`; the help names the variable."""
    var = "SPECDEC_" + name.upper().replace("-", "_")
    now = f"; set to {env(var)!r}".replace("%", "%%") if env(var) is not None else ""  # the help's "(default: on)" is the default without it
    p.add_argument("--" + name, action=argparse.BooleanOptionalAction, default=env_flag(var, default), help=f"{help} [env {var}{now}]")
    p.switches[name.replace("-", "_")] = var


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=PORT, default=default_port, help="0 picks a free port; a port in use is an error")
    p.add_argument("--metrics-port", type=PORT, default=None, help="serve Prometheus /metrics on this port (0 = any)")
    p.add_argument("--max-message-bytes", type=number(int, low=1024, high=2**31 - 1), default=16 << 20,  # gRPC's options are C ints
                   help="the largest gRPC message it sends or takes, in bytes")
    p.add_argument("--max-connection-age-s", type=number(float, above=0, high=(2**31 - 1) // 1000), default=None,  # ... in ms
                   help="close connections after this age so clients re-resolve")
    p.add_argument("--max-connection-age-grace-s", type=number(float, low=0, high=(2**31 - 1) // 1000), default=None,
                   help="with --max-connection-age-s: how long streams on a connection past its max age may run on "
                        "(default: until they end)")
    p.add_argument("--drain-s", type=number(float, low=0), default=30.0, help="grace period for running streams on SIGTERM")
    p.add_argument("--tls-cert", default=env("SPECDEC_TLS_CERT"), help="server certificate (PEM); enables TLS [env SPECDEC_TLS_CERT]")
    p.add_argument("--tls-key", default=env("SPECDEC_TLS_KEY"), help="server private key (PEM) [env SPECDEC_TLS_KEY]")
    p.add_argument("--tls-client-ca", default=env("SPECDEC_TLS_CLIENT_CA"),
                   help="CA bundle; when set, clients must present a certificate it signed (mTLS) [env SPECDEC_TLS_CLIENT_CA]")
    p.add_argument("--threads", type=number(int, low=1), default=None,
                   help="torch intra-op threads, >= 1 (default: torch's choice; 1 when sharing cores)")
    p.add_argument("--log-format", choices=["json", "text"], default="json", help="JSON lines or plain text on stderr")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="the least level logged")
    p.add_argument("--trace", choices=["off", "console"], default=env("SPECDEC_TRACE") or "off",
                   help="OpenTelemetry spans per request (console: JSON lines on stderr; needs opentelemetry-sdk) [env SPECDEC_TRACE]")


def device_arg(text: str) -> str:
    """--device's spelling, checked before torch loads (whether CUDA is there is checked after)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        where = " (from SPECDEC_DEVICE)" if text == os.environ.get("SPECDEC_DEVICE") else ""
        raise argparse.ArgumentTypeError(f"{text!r}{where}: expected auto, cpu, cuda or cuda:N")
    return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=os.environ.get("SPECDEC_DEVICE") or "auto", type=device_arg,
                   help="auto (cuda if present, else cpu), cpu, cuda or cuda:N [env SPECDEC_DEVICE]")
    p.add_argument("--dtype", default=os.environ.get("SPECDEC_DTYPE") or "auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's dtype on CUDA; on the CPU float32 where the CPU tier's row kernel runs and "
                        "the float32 weights fit in 40%% of free memory, else bfloat16 where the CPU has native bf16 "
                        "instructions (avx512_bf16 / AMX), else float32 [env SPECDEC_DTYPE]")
    p.add_argument("--engine-choices", type=_choices_arg, default=os.environ.get("SPECDEC_ENGINE_CHOICES") or "",
                   help="on the CPU, pin the engine's timed load-time choices, e.g. 'attention=float32,prepack=on,per-row=off,attention-kernel=on' "
                        "(default: timed at start-up; each service logs what it chose in this form; pinned, a restart "
                        "computes the same numbers, so a seeded request samples the same tokens) [env SPECDEC_ENGINE_CHOICES]")


def _choices_arg(text: str) -> dict:
    if not text.strip():
        return {}
    try:
        return parse_choices(text)
    except ValueError as e:
        where = " (from SPECDEC_ENGINE_CHOICES)" if text == os.environ.get("SPECDEC_ENGINE_CHOICES") else ""
        raise argparse.ArgumentTypeError(str(e).removeprefix("--engine-choices: ") + where) from None


def set_threads(torch, threads: int | None) -> None:
    """torch's intra-op threads (--threads), with a warning where they are more than this process
    may run on (its CPU affinity): each step's team then waits on preempted threads, 10-100x slower."""
    if not threads:
        return
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or threads
    if threads > usable:
        logging.getLogger("specdec.startup").warning(
            "--threads %d is more than the %d CPUs this process may run on: steps slow down many times over; give at most %d",
            threads, usable, usable)
    torch.set_num_threads(threads)
