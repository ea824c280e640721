"""specdec CLI.

  python -m client generate --server HOST:PORT --prompt TEXT [--json] ...
  python -m client info --server HOST:PORT

On a gRPC error it prints `error: CODE_NAME: message` to stderr and exits with status 1; a bad
flag or file exits 2; Ctrl-C exits 130 and a closed stdout (`| head`) 141, without a traceback."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.files import StartupError

from .core import MAX_RETRIES, MODES, PROPOSERS, Client, add_credential_args, credential_kwargs, field_error, make_request


def _ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not v > 0:  # NaN too; inf is allowed: no deadline
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {s!r}")
    return v


GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds")  # gRPC's own name schemes


def _address(s: str) -> str:
    """A gRPC target: HOST:PORT, or one of gRPC's URIs (dns:///h:p, unix:/path, ...). An empty one
    made gRPC print its own log lines and fail UNKNOWN; http://h:p failed UNAVAILABLE, which the
    retries and the fallback then tried again."""
    if not s.strip() or s != s.strip():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", s)
    if m and m.group(1).lower() not in GRPC_SCHEMES:
        raise argparse.ArgumentTypeError(f"{s!r}: a gRPC address is HOST:PORT (or a {'/'.join(GRPC_SCHEMES)} URI), not {m.group(1)}://")
    return s


def _connection_args(p: argparse.ArgumentParser, generate: bool = True) -> None:
    """The flags that reach --server; `generate`: also the fallback's and the retries (info asks --server only)."""
    p.add_argument("--server", required=True, type=_address, help="HOST:PORT of a draft service (or a verify service with --target-only)")
    p.add_argument("--target-only", action="store_true",
                   help="--server is a verify service: generate with the target alone" if generate else "--server is a verify service")
    p.add_argument("--timeout", type=_seconds, default=None, help="deadline in seconds (> 0; inf: none, the default)")
    if generate:
        p.add_argument("--fallback", type=_address, help="verify service HOST:PORT to use when the draft service is unavailable")
        p.add_argument("--retries", type=int, choices=range(MAX_RETRIES + 1), default=0, metavar=f"0..{MAX_RETRIES}",
                       help=f"retries (at most {MAX_RETRIES}, gRPC's retry policy) on UNAVAILABLE or RESOURCE_EXHAUSTED before the first "
                       "token, after the server's pushback")
    add_credential_args(p, fallback=generate)


def parse(argv):
    installed = not sys.argv[0].endswith("__main__.py")  # the specdec-client script, not python -m client
    p = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]) if installed else "python -m client", description="specdec client")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion")
    _connection_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--tau", type=int, default=0, help="draft tokens per round (0 = server default); with --tree-budget, the tree's depth")
    g.add_argument("--tree-budget", type=int, default=0, help="tree speculation: the most draft nodes per round (0 = chains)")
    g.add_argument("--mode", choices=sorted(MODES), default=None, help="proposal mode")
    g.add_argument("--sparse-k", type=int, default=0)
    g.add_argument("--proposer", choices=sorted(PROPOSERS), default=None, help="draft model, prompt lookup, or lookup then draft")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None, help="adaptive tau (default: the server's)")
    g.add_argument("--predraft", action=argparse.BooleanOptionalAction, default=None, help="pre-drafting (default: the server's)")
    g.add_argument("--early-stop-p", type=float, default=0.0, help="end a round when the draft's top probability falls below this")
    g.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="tokenize --prompt with the tokenizer's special tokens, e.g. BOS (default: yes, as the tokenizer does)")
    g.add_argument("--request-id", default="")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    i = sub.add_parser("info", help="print the service's model info (asks --server only: no fallback, no retries)")
    _connection_args(i, generate=False)
    i.set_defaults(fallback=None, retries=0)
    return p.parse_args(argv)


def _flag(field: str) -> str:
    return "--tau" if field == "num_draft_tokens" else f"--{field.replace('_', '-')}"


def main(argv=None) -> int:
    a = parse(argv)
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_interrupt)  # Python's own handler, in the main thread: not a host program's
    try:
        code = _run(a)
        sys.stdout.flush()  # here, not at the interpreter's exit: a reader gone by now is the BrokenPipeError below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): nothing more to write, and nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush does not fail too
        return 141
    except Exception:
        if interrupted:  # Ctrl-C inside gRPC's locks can surface as another error (RuntimeError: cannot release
            return 130  # un-acquired lock): still an interrupt, not a failure
        raise


def _run(a) -> int:
    fallback_tls = [f"--fallback-tls-{part}" for part in ("ca", "cert", "key") if getattr(a, f"fallback_tls_{part}", None)]
    unused = ("--fallback with --target-only (the fallback is a verify service for a draft service's requests)" if a.fallback and a.target_only
              else "--fallback-token-file without --fallback" if getattr(a, "fallback_token_file", None) and not a.fallback
              else f"{fallback_tls[0]} without --fallback" if fallback_tls and not a.fallback else None)
    if unused:  # a flag that would be dropped without a word
        print(f"error: {unused}", file=sys.stderr)
        return 2
    try:
        client = Client(a.server, target_only=a.target_only, fallback=a.fallback, timeout=a.timeout, retries=a.retries,
                        **credential_kwargs(a))
    except (OSError, ValueError, StartupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wrote = False
    try:
        if a.cmd == "info":
            print(json.dumps(MessageToDict(client.info(), preserving_proto_field_name=True), indent=2))
            return 0
        why = field_error(dict(prompt=a.prompt, prompt_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                               top_k=a.top_k, top_p=a.top_p, early_stop_p=a.early_stop_p, seed=a.seed,
                               stop=a.stop, num_draft_tokens=a.tau, sparse_k=a.sparse_k, request_id=a.request_id,
                               tree_budget=a.tree_budget), name=_flag)
        if why:
            print(f"error: INVALID_ARGUMENT: {why}", file=sys.stderr)
            return 1
        req = make_request(prompt=a.prompt, prompt_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                           top_k=a.top_k, top_p=a.top_p, seed=a.seed, stop=a.stop, num_draft_tokens=a.tau,
                           proposal_mode=a.mode, sparse_k=a.sparse_k, request_id=a.request_id, proposer=a.proposer,
                           adaptive=a.adaptive, predraft=a.predraft, early_stop_p=a.early_stop_p,
                           add_special_tokens=a.add_special_tokens, tree_budget=a.tree_budget)
        if a.json:
            print(json.dumps(client.generate(req).to_dict()))
            return 0
        last = None
        for chunk in client.stream(req):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
            wrote = True
        sys.stdout.write("\n")
        if last is not None:
            print(json.dumps(MessageToDict(last.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)),
                  file=sys.stderr)
        return 0
    except grpc.RpcError as e:
        if wrote:  # the error on a line of its own, not after the partial text on a terminal
            sys.stdout.write("\n")
            sys.stdout.flush()
        details = " ".join(str(e.details()).split())
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            details += (" (with --target-only, --server must be a verify service: is it a draft service?)" if a.target_only else
                        " (is --server a verify service? add --target-only; or --fallback a draft service?)")
        print(f"error: {e.code().name}: {details}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
