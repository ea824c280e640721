"""Start-up calibration of the costs that adaptive tau plans with (specdec/costmodel.Costs):
the draft's step time, measured on the draft model, and a verify round's time as the draft sees
it (network and RPC included) for 0 and for 8 proposals, measured over a short probe session
with the verify service. Measured once, so a request's taus depend on its own acceptance
history only; `--costs-ms` pins them instead (the same taus across restarts too)."""
from __future__ import annotations

import statistics
import time

import grpc
import torch

from specdec.costmodel import Costs
from specdec.kvcache import KVCache
from specdec.v1 import specdec_pb2 as pb

PROBE_GAMMA = 8


def parse_costs(text: str) -> Costs:
    """'DRAFT_STEP,VERIFY_BASE,VERIFY_PER_TOKEN' in milliseconds."""
    try:
        d, vb, vt = (float(x) / 1e3 for x in text.split(","))
    except ValueError:
        raise ValueError(f"--costs-ms: expected three numbers 'draft_step,verify_base,verify_per_token' in ms, got {text!r}") from None
    if min(d, vb, vt) < 0 or d == 0 or vb == 0:
        raise ValueError(f"--costs-ms: draft_step and verify_base must be > 0 and none negative, got {text!r}")
    return Costs(d, vb, vt)


def draft_step_seconds(drafter, steps: int = 12) -> float:
    """Median time of a one-token draft step after a 16-token context, through the step batcher."""
    V = drafter.lm.vocab_size
    ids = [i % V for i in range(16)]
    cache = KVCache(16 + steps + 4)
    drafter.batcher.forward(cache, ids, logits=False)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        logits = drafter.batcher.forward(cache, [ids[i % len(ids)]])
        int(torch.argmax(logits))  # what a step waits for
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


async def verify_round_seconds(stub, fingerprint: str, vocab_size: int, max_context: int, rounds: int = 6) -> tuple[float, float]:
    """(base, per_token): median round trip of a round with 0 and with up to PROBE_GAMMA proposals."""
    call = stub.Session(metadata=[("x-request-id", "specdec-calibration")])
    prompt = [i % vocab_size for i in range(min(8, max_context // 4))]
    gamma_max = max(1, min(PROBE_GAMMA, max_context // 4))
    await call.write(pb.VerifyRequest(start=pb.SessionStart(prompt_ids=prompt, max_new_tokens=min(512, max_context - len(prompt)),
                                                           proposal_mode=pb.PROPOSAL_MODE_GREEDY, vocab_fingerprint=fingerprint,
                                                           request_id="specdec-calibration")))
    times: dict[int, list[float]] = {0: [], gamma_max: []}
    used = len(prompt)
    try:
        for r in range(2 * (rounds + 1)):
            gamma = gamma_max if r % 2 else 0
            if used + gamma + 1 >= max_context:
                break
            t0 = time.perf_counter()
            await call.write(pb.VerifyRequest(round=pb.Round(round=r + 1, tokens=(prompt * gamma)[:gamma])))
            v = await call.read()
            if v is grpc.aio.EOF:
                raise RuntimeError("verify service ended the calibration session")
            if r >= 2:  # the first round of each size is a warm-up
                times[gamma].append(time.perf_counter() - t0)
            used += v.num_accepted + 1
            if v.finish_reason:
                break
    finally:
        call.cancel()
    if not times[0] or not times[gamma_max]:
        raise RuntimeError("the verify service's context is too short to calibrate round costs; pin them with --costs-ms")
    base = statistics.median(times[0])
    return base, max(0.0, (statistics.median(times[gamma_max]) - base) / gamma_max)
