"""What a sampled round's q costs the verify service's host, at a large vocabulary: decoding and
checking one round (`proposal.decode_round`, on the event loop), and gathering a pass's rounds
for their copy to the device (the host part of `verify_service.jobs._q`), against the dense host
tables the verifier built before (a [tau, V] table per round, stacked into [B, T, V] per pass).

    python -m bench.roundq [--vocab 128256 --tau 8 --sparse-k 32 --sessions 64 --repeats 3]

Random draft distributions, sparse mode (the default), one torch thread; the best of --repeats.
Prints a Markdown table (no files: the numbers go in bench/results/PASSES.md by hand)."""
from __future__ import annotations

import argparse
import time

import torch

from specdec.proposal import Proposal, decode_round
from specdec.sampling import sparsify
from specdec.v1 import specdec_pb2 as pb


def rounds(V: int, tau: int, k: int, n: int) -> list[pb.Round]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prop = Proposal()
        for _ in range(tau):
            ids, vals = sparsify(torch.softmax(torch.randn(V, generator=g) * 3, -1), k)
            prop.add(int(ids[0]), pb.PROPOSAL_MODE_SPARSE, vals, ids)
        out.append(pb.Round.FromString(prop.to_round(1).SerializeToString()))  # as the wire delivers it
    return out


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.roundq", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--sparse-k", type=int, default=32)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    V, B = a.vocab, a.sessions
    wire = rounds(V, a.tau, a.sparse_k, B)
    qs = []

    def decode():
        qs[:] = [decode_round(r, expected=1, room=1 << 20, vocab_size=V, mode=pb.PROPOSAL_MODE_SPARSE, greedy=False)[1] for r in wire]

    decode_s = best(decode, a.repeats) / B

    def gather():  # the host part of jobs._q: the entries' index and value tensors
        torch.cat([torch.stack((torch.full_like(q.rows, i), q.rows, q.ids)) for i, q in enumerate(qs)], 1)
        torch.cat([q.probs for q in qs])

    gather_s = best(gather, a.repeats)
    dense_round_s = best(lambda: [q.dense(V) for q in qs], a.repeats) / B  # what decode_round built besides its checks before
    tables = [q.dense(V) for q in qs]

    def stack():  # the pass's host table before
        t = torch.zeros(B, a.tau, V)
        for i, q in enumerate(tables):
            t[i, : q.shape[0]] = q

    stack_s = best(stack, a.repeats)
    print(f"V = {V}, tau = {a.tau}, sparse K = {a.sparse_k}, {B} sessions, one thread, best of {a.repeats}\n")
    print("| host work | entries (now) | dense host tables (before) |\n|---|---|---|")
    print(f"| a round: decode and check | {decode_s * 1e3:.2f} ms | + {dense_round_s * 1e3:.2f} ms for its [tau, V] table |")
    print(f"| a pass of {B} rounds: gather for the device | {gather_s * 1e3:.2f} ms | {stack_s * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
