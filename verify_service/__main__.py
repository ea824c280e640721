"""python -m verify_service --model DIR --port P [--host H] ..."""
from __future__ import annotations

import argparse
import asyncio
import sys

import torch

from specdec import auth, logs, serving
from specdec.lm import LM, Unsupported, add_model_args
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from verify_service.scheduler import Scheduler
from verify_service.server import VerifyServicer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m verify_service", description="specdec verify service (target model)")
    serving.add_server_args(p, default_port=50051)
    add_model_args(p)
    p.add_argument("--max-sessions", type=int, default=64, help="live sessions before RESOURCE_EXHAUSTED")
    p.add_argument("--max-cached-tokens", type=int, default=None, help="token budget of all KV caches (default: max-sessions x context, capped by the free memory where the caches live: 90%% of a GPU's, 50%% of the host's)")
    p.add_argument("--idle-timeout-s", type=float, default=60.0, help="close a session that sends nothing for this long")
    auth.add_server_args(p, client_tokens=True)
    args = p.parse_args(argv)
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    logs.setup(args.log_format, args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lm = LM.load(args.model, args.device, args.dtype, choices=args.engine_choices)
    except Unsupported as e:
        print(f"verify_service: {e}", file=sys.stderr)
        sys.exit(2)
    engine = Scheduler(lm, max_sessions=args.max_sessions, max_cached_tokens=args.max_cached_tokens)
    servicer = VerifyServicer(engine, idle_timeout_s=args.idle_timeout_s)
    asyncio.run(serving.serve(args, "specdec.v1.Verify", lambda s: pb_grpc.add_VerifyServicer_to_server(servicer, s),
                              interceptors=[token_auth], on_stop=engine.shutdown))


if __name__ == "__main__":
    main()
