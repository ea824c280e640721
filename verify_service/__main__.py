"""python -m verify_service --model DIR --port P [--host H] ..."""
from __future__ import annotations

import argparse
import asyncio

import torch

from specdec import auth, logs, serving
from specdec.lm import LM
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from verify_service.engine import Engine
from verify_service.server import VerifyServicer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m verify_service", description="specdec verify service (target model)")
    serving.add_server_args(p, default_port=50051)
    p.add_argument("--max-sessions", type=int, default=64, help="live sessions before RESOURCE_EXHAUSTED")
    p.add_argument("--max-cached-tokens", type=int, default=None, help="token budget of all KV caches (default: max-sessions x context, capped by a quarter of available memory)")
    p.add_argument("--idle-timeout-s", type=float, default=60.0, help="close a session that sends nothing for this long")
    auth.add_server_args(p, client_tokens=True)
    args = p.parse_args(argv)
    token_auth = auth.server_interceptor(args)  # reads the token files: fail at start-up, not on the first request
    logs.setup(args.log_format, args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(LM.load(args.model), max_sessions=args.max_sessions, max_cached_tokens=args.max_cached_tokens)
    servicer = VerifyServicer(engine, idle_timeout_s=args.idle_timeout_s)
    asyncio.run(serving.serve(args, "specdec.v1.Verify", lambda s: pb_grpc.add_VerifyServicer_to_server(servicer, s),
                              interceptors=[token_auth], on_stop=engine.shutdown))


if __name__ == "__main__":
    main()
