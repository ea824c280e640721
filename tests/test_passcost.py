"""The verifier's pass cost model (verify_service/passcost.py): the fit, the busy share and the
price of a proposal row, on synthetic passes whose true costs are known."""
import math

import pytest

from verify_service.passcost import BUSY_WINDOW_S, PassCost

BASE, ROW, SESSION = 0.004, 0.0005, 0.0002


def run(pc: PassCost, layouts, gap: float = 0.0) -> None:
    """Passes back to back (gap 0) or with `gap` idle seconds after each, two tokens a session."""
    t = 100.0
    for rows, sessions in layouts:
        s = BASE + ROW * rows + SESSION * sessions
        pc.observe(rows, sessions, 2 * sessions, s, t)
        t += s + gap


def test_the_fit_recovers_the_costs_and_forgets_old_hardware():
    slow = [(r, s, 2 * (BASE + 2 * ROW * r + SESSION * s)) for r, s in [(1, 1), (9, 1), (8, 8), (40, 8)]]
    pc = PassCost(slow)  # probed while the machine was busier
    assert pc.per_row_s == pytest.approx(4 * ROW, rel=0.01)
    run(pc, [(r, s) for r, s in [(5, 1), (20, 4), (80, 16), (40, 16), (9, 3)] * 40])
    assert pc.base_s == pytest.approx(BASE, rel=0.15)  # the probe still pulls a little (it is never forgotten)
    assert pc.per_row_s == pytest.approx(ROW, rel=0.05)
    assert pc.per_session_s == pytest.approx(SESSION, rel=0.2)


def test_all_passes_alike_keep_the_probes_slope():
    """Passes of one layout only cannot tell rows from base: the start-up probe keeps the slope."""
    pc = PassCost([(1, 1, BASE + ROW + SESSION), (9, 1, BASE + 9 * ROW + SESSION), (8, 8, BASE + 8 * ROW + 8 * SESSION)])
    run(pc, [(5, 1)] * 200)
    assert pc.per_row_s == pytest.approx(ROW, rel=0.05)


def test_price_is_row_cost_times_goodput_times_busy_share():
    """Passes of 20 rows from 4 sessions, 8 tokens each: back to back the price is per_row x
    tokens per pass-second; with 0.2 s idle after each pass, that times the busy share."""
    truth = [(r, s, BASE + ROW * r + SESSION * s) for r, s in [(1, 1), (9, 1), (8, 8), (40, 8)]]
    busy, idle = PassCost(truth), PassCost(truth)
    run(busy, [(20, 4)] * 200)  # two tokens a session: 8 a pass
    run(idle, [(20, 4)] * 200, gap=0.2)
    s = BASE + ROW * 20 + SESSION * 4
    assert busy.utilisation == pytest.approx(1.0)
    # weighted by age (BUSY_WINDOW_S), read as a pass begins (the gap the latest time): a little under s / (s + gap)
    t, g = BUSY_WINDOW_S, 0.2
    share = (1 - math.exp(-s / t)) * math.exp(-g / t) / (1 - math.exp(-(s + g) / t))
    assert share == pytest.approx(s / (s + g), rel=0.15)
    assert idle.utilisation == pytest.approx(share, rel=1e-3)
    assert busy.price == pytest.approx(ROW * 8 / s, rel=1e-3)
    assert idle.price == pytest.approx(ROW * 8 / s * share, rel=1e-3)
    assert PassCost().price == 0.0  # a verifier that has not run yet asks nothing


def test_the_solve_is_least_squares_and_minimum_norm_where_singular():
    """The plain-float solve of the normal equations agrees with torch's least squares, on
    well-posed systems and on singular ones (passes all alike, no probes: the minimum-norm fit)."""
    import random

    import torch

    from verify_service.passcost import _normal, _solve

    rnd = random.Random(0)
    for _ in range(200):
        points = [(rnd.randint(1, 1000), rnd.randint(1, 64), rnd.random()) for _ in range(rnd.randint(3, 30))]
        a, b = _normal(points, 1.0)
        want = torch.linalg.lstsq(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)[:, None]).solution[:, 0]
        assert _solve(a, b) == pytest.approx(want.tolist(), rel=1e-6, abs=1e-12)
    a, b = _normal([(5, 1, 0.01)] * 10, 1.0)  # one layout only: rank 1
    x = _solve(a, b)
    assert 1 * x[0] + 5 * x[1] + 1 * x[2] == pytest.approx(0.01)  # fits the passes it saw
    assert x == pytest.approx([v * 0.01 / 27 for v in (1, 5, 1)])  # the minimum-norm one: along (1, 5, 1)


def test_the_busy_share_falls_while_the_verifier_is_idle():
    """utilisation_at (the gauges' value) counts the time since the last pass: right after a run
    of back-to-back passes it reads busy, and it falls as idle time passes, where `utilisation`
    (which moves only when a pass begins) would keep its last value."""
    pc = PassCost()
    assert pc.utilisation_at(0.0) == 0.0 and pc.price_at(0.0) == 0.0
    run(pc, [(20, 4)] * 50)
    s = BASE + ROW * 20 + SESSION * 4
    end = 100.0 + 50 * s
    assert pc.utilisation_at(end) == pytest.approx(1.0, rel=1e-6)
    later = [pc.utilisation_at(end + idle) for idle in (0.1, 1.0, 10.0)]
    assert later[0] > later[1] > later[2] and later[2] < 0.05
    assert pc.utilisation == pytest.approx(1.0) and pc.price_at(end + 10.0) < 0.05 * pc.price


def test_a_pass_in_flight_counts_busy_while_it_runs():
    """The gauges' busy share counted only finished passes: a pass that ran for seconds (a long
    prompt's chunk) read as ever more idle while it ran. Given when the pass in flight began,
    its time so far is busy; a start at or before the last observed pass's end is that pass."""
    pc = PassCost()
    assert pc.utilisation_at(5.0, running=4.0) == pytest.approx(1.0)  # the first pass, in flight
    run(pc, [(20, 4)] * 50)
    s = BASE + ROW * 20 + SESSION * 4
    end = 100.0 + 50 * s
    idle = pc.utilisation_at(end + 3.0)
    assert idle < 0.1  # three seconds since the last pass ended, nothing in flight
    assert pc.utilisation_at(end + 3.0, running=end + 0.5) > 0.9  # a pass began half a second after it: 2.5 s busy
    assert pc.utilisation_at(end + 3.0, running=end - s) == pytest.approx(idle)  # the last pass itself: counted once
    assert pc.price_at(end + 3.0, running=end + 0.5) > 10 * pc.price_at(end + 3.0)


def test_a_model_with_a_short_context_starts_and_serves(tmp_path, monkeypatch):
    """The start-up probe put 32 tokens of context before up to 9 rows: a model with learned
    positions and a context under 41 (a tiny gpt2, an architecture on the tested list) ended the
    verify service's start in an IndexError traceback. Its probes now fit the context (shorter
    contexts; a layout whose rows cannot fit is left out), and it serves."""
    import asyncio

    from helpers import archmodels
    from specdec.lm import LM
    from specdec.sampling import Sampling
    from specdec.v1 import specdec_pb2 as pb
    from verify_service.scheduler import Scheduler

    cfg, model, kw, extra = archmodels.SPECS["gpt2"]
    monkeypatch.setitem(archmodels.SPECS, "gpt2", (cfg, model, dict(kw, n_positions=16), extra))
    lm = LM.load(archmodels.build(str(tmp_path), "gpt2"), "cpu", "float32")
    eng = Scheduler(lm, max_sessions=2)

    async def serve() -> list[int]:
        s = eng.open([3, 4, 5], 5, Sampling(temperature=0.0), seed=1, mode=pb.PROPOSAL_MODE_GREEDY)
        try:
            return [v.next_token async for v in eng.steps(s)]
        finally:
            eng.close(s)

    try:
        got = asyncio.run(asyncio.wait_for(serve(), 60))
    finally:
        eng.shutdown()
    assert lm.max_context == 16 and 1 <= len(got) <= 5


def test_a_long_idle_spell_is_forgotten_within_the_busy_window():
    """The busy share ages by time: an hour idle weighed an hour against each later pass's few
    ms (its span decayed per pass), so a saturated verifier read idle, and priced rows at about
    0, for hundreds of passes after a lull (utilisation 0.003 after 100 back-to-back passes)."""
    pc = PassCost()
    run(pc, [(20, 4)] * 200)
    s = BASE + ROW * 20 + SESSION * 4
    t = 100.0 + 200 * s + 3600.0  # an hour later, passes back to back again
    for rows, sessions in [(20, 4)] * 100:
        pc.observe(rows, sessions, 2 * sessions, s, t)
        t += s
    back = 100 * s
    assert back < 3 * BUSY_WINDOW_S
    assert pc.utilisation == pytest.approx(1 - math.exp(-(back - s) / BUSY_WINDOW_S), rel=1e-3)  # all the idle weight left
