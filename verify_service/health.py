"""Whether the verify service's passes work, judged from their outcomes (DESIGN.md §6).

A pass faulted when it raised past the model call's guard, or gave no verdict and something in
it failed other than by a refusal (a RequestError: a closed session, NaN logits, bad input); a
prompt chunk going in is neither. FAULT_PASSES in a row mean the service is broken (a lost
device, a bug every pass meets): logged, counted, and `on_health` told, so both its readiness
and its liveness are NOT_SERVING. While broken and idle the scheduler runs a self-test pass now
and then (`self_tested`); one that succeeds makes it ready again (traffic comes back), but only a
verdict makes it live: a fault the self-test's short path does not meet breaks it at the next
pass (the count is not reset), and so keeps it not live until the orchestrator restarts it.
Everything here runs on the scheduler's thread.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from specdec import metrics
from specdec.errors import RequestError

log = logging.getLogger("specdec.verify")

FAULT_PASSES = 3  # passes in a row that faulted mark the service broken
SELF_TEST_S = 2.0  # while broken and idle, a one-token pass this often: one that succeeds lets traffic back in


class PassHealth:
    def __init__(self):
        self.faults = 0  # passes in a row that faulted
        self.broken: str | None = None  # why the passes keep failing, until a verdict is given again
        self.retrying = False  # broken, but a self-test pass succeeded: ready for traffic, not yet live
        self.on_health: Callable[[bool, bool], None] | None = None  # (ready, live), told when they change

    @property
    def wants_self_test(self) -> bool:
        return self.broken is not None and not self.retrying

    def judge(self, outcomes: list[tuple[bool, object]], fault: Exception | None) -> None:
        """A pass's outcomes, (ok, verdict or error) per job resolved, and the fault it raised if any."""
        if any(ok and r is not None for ok, r in outcomes):  # a verdict: the passes work
            self.faults = 0
            self._set(None)
            return
        fault = fault or next((r for ok, r in outcomes if not ok and not isinstance(r, RequestError)), None)
        if fault is None:
            return
        self.faults += 1
        metrics.PASS_FAULTS.inc()
        if self.faults >= FAULT_PASSES:
            self._set(f"{self.faults} verify passes in a row failed, the last with {type(fault).__name__}: {fault}")

    def self_tested(self, error: Exception | None) -> None:
        """A self-test pass's outcome: one that succeeds makes the service ready for traffic again
        (`retrying`); the next pass's verdicts decide the rest."""
        if error is not None:
            log.warning("verify self-test pass failed (%s: %s); still not serving", type(error).__name__, error)
            return
        log.warning("verify self-test pass succeeded: ready for traffic again; live once a pass gives verdicts")
        self.retrying = True
        self._tell()

    def _set(self, broken: str | None) -> None:
        if broken is None and self.broken is None:
            return
        if broken is not None and self.broken is not None and not self.retrying:
            return  # broken already
        if broken:
            log.error("%s: reporting NOT_SERVING until a pass gives verdicts (a self-test pass every %gs while idle)", broken,
                      SELF_TEST_S)
        else:
            log.warning("verify passes give verdicts again: serving")
        self.broken, self.retrying = broken, False
        self._tell()

    def _tell(self) -> None:
        metrics.VERIFY_BROKEN.set(0 if self.broken is None else 1)
        if self.on_health is not None:
            try:
                self.on_health(self.broken is None or self.retrying, self.broken is None)
            except Exception:  # noqa: BLE001 - the event loop is gone (shutting down): nobody to tell
                log.debug("health not updated", exc_info=True)
