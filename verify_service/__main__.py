"""python -m verify_service --model DIR --port P [--host H] ...

Flags and token files are checked before the model libraries load; any start-up failure is one
stderr line and exit code 2 (specdec/startup.py)."""
from __future__ import annotations

import argparse
import asyncio

from specdec import auth, startup
from specdec.startup import number


def parser() -> startup.Parser:
    """The service's flags (their defaults read from the environment now)."""
    p = startup.Parser(prog="python -m verify_service", description="specdec verify service (target model)")
    startup.add_server_args(p, default_port=50051)
    startup.add_model_args(p)
    p.add_argument("--max-sessions", type=number(int, low=1), default=64, help="live sessions before RESOURCE_EXHAUSTED (>= 1)")
    p.add_argument("--max-cached-tokens", type=startup.or_auto(number(int, low=1)), default=None,
                   help="token budget of all KV caches (default, or auto: max-sessions x context, capped by the free memory where the "
                        "caches live: 90%% of a GPU's, 50%% of the host's (no more than its memory cgroup, a pod's limit, leaves), but at least one session at full context; a value above that memory "
                        "share, or a share below one such session, is logged as a warning)")
    p.add_argument("--idle-timeout-s", type=number(float, above=0), default=60.0, help="close a session that sends nothing, or takes no verdict, for this long (> 0)")
    p.add_argument("--stalled-pass-s", type=number(float, low=0), default=300.0,
                   help="a pass running longer than this (a wedged device) makes the service NOT_SERVING and Info UNAVAILABLE "
                        "until it returns (0: not watched; default 300)")
    p.add_argument("--gather", type=number(float, low=0, high=1), default=0.25,
                   help="before a pass, wait at most this share of the last pass's time for the next rounds of the sessions "
                        "the last pass answered, so sessions in step share passes (0: start at once; default 0.25)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, capture each uniform shape of a pass of rounds as a CUDA graph and replay it "
                        "(default: on where the model runs on CUDA; the CPU has none)")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="on a GPU, compile the decoder layers with torch.compile (fused kernels, captured in the CUDA graphs) "
                        "at start-up; a model that cannot be compiled runs uncompiled, with a warning (default: on where "
                        "the model runs on CUDA)")
    p.add_argument("--max-prefill-rows", type=number(int, low=1), default=None,
                   help="rows of prompt chunks and rounds in one pass (at least one chunk a pass; default: 1024 on the CPU, "
                        "8192 on a GPU)")
    auth.add_server_args(p, client_tokens=True)
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    startup.check_server_args(p, args)
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    startup.check_files(args, "tls_cert", "tls_key", "tls_client_ca")
    startup.check_model_dir(args.model)
    startup.check_port(args.host, args.port, "--port")
    startup.check_port(args.host, args.metrics_port, "--metrics-port")

    import torch  # noqa: PLC0415 - the heavy libraries load once the cheap checks have passed

    from specdec import logs, serving, tracing  # noqa: PLC0415
    from specdec.lm import LM  # noqa: PLC0415
    from specdec.v1 import specdec_pb2_grpc as pb_grpc  # noqa: PLC0415
    from verify_service.scheduler import Scheduler  # noqa: PLC0415
    from verify_service.server import VerifyServicer  # noqa: PLC0415

    logs.setup(args.log_format, args.log_level)
    tracing.setup("specdec.v1.Verify", args.trace)  # before the model loads: a --trace without its package is refused at once
    startup.set_threads(torch, args.threads)
    lm = LM.load(args.model, args.device, args.dtype, choices=args.engine_choices, graphs=args.cuda_graphs,
                 compiled=args.compile_layers)
    engine = Scheduler(lm, max_sessions=args.max_sessions, max_cached_tokens=args.max_cached_tokens, gather=args.gather,
                       max_prefill_rows=args.max_prefill_rows)
    servicer = VerifyServicer(engine, idle_timeout_s=args.idle_timeout_s, stalled_pass_s=args.stalled_pass_s)
    asyncio.run(serving.serve(args, "specdec.v1.Verify", lambda s: pb_grpc.add_VerifyServicer_to_server(servicer, s),
                              interceptors=[token_auth], on_stop=engine.shutdown, on_start=servicer.on_start))


if __name__ == "__main__":
    startup.main("python -m verify_service", main)  # the prog its flag errors name (argparse)
