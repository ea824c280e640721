"""Start-up calibration of the costs that adaptive tau plans with (specdec/costmodel.Costs):
the draft's step time, measured on the draft model, and a verify round's time as the draft sees
it (network and RPC included) for 0 and for 8 proposals, measured over a short probe session
with the verify service (whatever the target writes: sessions that end are replaced). If the
rounds cannot be timed, `fallback_costs` (conservative: short taus) and one warning; it never
stops the service from starting. Measured once, so a request's taus depend on its own acceptance
history only; `--costs-ms` pins them instead (the same taus across restarts too)."""
from __future__ import annotations

import asyncio
import math
import statistics
import time

import grpc
import torch

from specdec import serving
from specdec.costmodel import Costs
from specdec.engine import KVCache
from specdec.v1 import specdec_pb2 as pb

PROBE_GAMMA = 8
CALIBRATION_TIMEOUT_S = 30.0
FALLBACK_ROUND_STEPS = 3.0


def parse_costs(text: str) -> Costs:
    """'DRAFT_STEP,VERIFY_BASE,VERIFY_PER_TOKEN' in milliseconds."""
    try:
        d, vb, vt = (float(x) / 1e3 for x in text.split(","))
    except ValueError:
        raise ValueError(f"--costs-ms: expected three numbers 'draft_step,verify_base,verify_per_token' in ms, got {text!r}") from None
    if not all(map(math.isfinite, (d, vb, vt))) or min(d, vb, vt) < 0 or d == 0 or vb == 0:
        raise ValueError(f"--costs-ms: draft_step and verify_base must be finite, > 0 and none negative, got {text!r}")
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


async def verify_round_seconds(stub, fingerprint: str, vocab_size: int, max_context: int, eos=frozenset(), rounds: int = 6,
                               timeout_s: float = CALIBRATION_TIMEOUT_S) -> tuple[float, float]:
    """(base, per_token): median round trip of a round with 0 and with up to PROBE_GAMMA proposals.

    What the target writes does not matter: the probe proposes no EOS id, and a session that ends
    anyway (the target wrote EOS, or reached a limit) is replaced by a new one, so every round
    is a round trip to time. Bounded: at most 4 * (rounds + 1) rounds, within `timeout_s`.
    Raises (grpc.aio.AioRpcError, RuntimeError) if it cannot measure; the caller falls back."""
    ok = [i for i in range(min(vocab_size, 64)) if i not in eos] or [0]
    prompt = (ok * 8)[:max(1, min(8, max_context // 4))]
    gamma_max = max(1, min(PROBE_GAMMA, max_context // 4))
    times: dict[int, list[float]] = {0: [], gamma_max: []}
    deadline = time.monotonic() + timeout_s
    call, used, number = None, 0, 0
    budget = 4 * (rounds + 1) * (gamma_max + 1)  # what every round could write: the verifier reserves no more cache than that
    try:
        for r in range(4 * (rounds + 1)):
            if min(len(times[0]), len(times[gamma_max])) >= rounds:
                break
            gamma = gamma_max if r % 2 else 0
            if call is not None and used + gamma + 1 >= max_context:
                await serving.release(call)
                call = None
            if call is None:  # a new session: the first, or the last one ended
                call = stub.Session(metadata=[("x-request-id", "specdec-calibration")], timeout=max(0.1, deadline - time.monotonic()))
                await _write(call, pb.VerifyRequest(start=pb.SessionStart(
                    prompt_ids=prompt, max_new_tokens=max(1, min(budget, max_context - len(prompt))),
                    proposal_mode=pb.PROPOSAL_MODE_GREEDY, vocab_fingerprint=fingerprint, request_id="specdec-calibration")))
                used, number = len(prompt), 0
            number += 1
            t0 = time.perf_counter()
            await _write(call, pb.VerifyRequest(round=pb.Round(round=number, tokens=(ok * gamma)[:gamma])))
            v = await call.read()
            if v is grpc.aio.EOF:
                raise RuntimeError("the verify service ended a calibration session without a verdict")
            if r >= 2:  # the first round of each size is a warm-up
                times[gamma].append(time.perf_counter() - t0)
            used += v.num_accepted + 1
            if v.finish_reason:  # EOS or a limit: whatever the target wrote, go on in a new session
                await call.code()  # once the verify service has closed this one (its capacity is free again)
                await serving.release(call)
                call = None
    finally:
        if call is not None:
            await serving.release(call)
    if not times[0] or not times[gamma_max]:
        raise RuntimeError("no round could be timed")
    base = statistics.median(times[0])
    return base, max(0.0, (statistics.median(times[gamma_max]) - base) / gamma_max)


async def _write(call, msg) -> None:
    try:
        await call.write(msg)
    except asyncio.InvalidStateError:  # the verify service already ended the call: its status says why
        raise RuntimeError(f"the verify service ended a calibration session: {(await call.code()).name}: {await call.details()}") from None


def fallback_costs(draft_step: float) -> Costs:
    """Conservative costs when the verify rounds could not be timed: a round as dear as
    FALLBACK_ROUND_STEPS draft steps, so adaptive tau stays short (a cheap round favours few
    proposals) until --costs-ms pins measured ones."""
    step = draft_step if draft_step > 0 else 1e-3
    return Costs(step, FALLBACK_ROUND_STEPS * step, step / 4)
