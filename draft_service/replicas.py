"""The verify replicas a draft service opens its sessions on.

`--verify` names one verify service (`HOST:PORT`), a list of them (`A:P,B:P`), or a DNS name
whose every address is a replica (`dns:///NAME:PORT`, e.g. a Kubernetes headless Service,
resolved again at every poll, so replicas that come and go are followed). Each replica gets a
channel of its own, and every `poll_s` its Info: whether it answers, and its free capacity.

A session goes to the reachable replica with the most free sessions (ties in turn); a replica
that refuses it (RESOURCE_EXHAUSTED) or cannot be reached (UNAVAILABLE) before the session's
first verdict is passed over for the next (draft_service/server.py). The draft is ready
(health SERVING) while at least one replica answers and serves its vocabulary, tokenizer and
context (draft_service/upstream.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from dataclasses import dataclass, field
from typing import Callable

import grpc

from draft_service import adaptive
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger("specdec.draft")


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.VerifyStub = field(init=False)
    info: pb.ModelInfo | None = None  # its last Info answer; None until it answers
    reachable: bool = False
    error: grpc.aio.AioRpcError | None = None  # why its last Info failed
    open: int = 0  # sessions this draft has open on it now
    open_at_poll: int = 0  # ... when its last Info answered

    def __post_init__(self):
        self.stub = pb_grpc.VerifyStub(self.channel)

    @property
    def free_sessions(self) -> int:
        """Its free sessions as of its last Info, less those this draft has opened there since
        (a burst of sessions between two polls is spread, not sent to one replica)."""
        free = self.info.capacity.free_sessions if self.info is not None and self.info.HasField("capacity") else 0
        return free - (self.open - self.open_at_poll)

    def refused(self) -> None:
        """It refused a session for now (full, or gone): rank it last until its next Info says otherwise."""
        if self.info is not None:
            self.info.capacity.free_sessions = 0
            self.open_at_poll = self.open - 1  # the refused session, still counted, ends at once


def parse_target(target: str) -> tuple[str | None, list[str]]:
    """(DNS name:port to resolve, or None; the fixed addresses) of a --verify value."""
    if target.startswith("dns:"):
        return target.removeprefix("dns:").lstrip("/"), []
    return None, [a.strip() for a in target.split(",") if a.strip()]


async def resolve(name: str) -> list[str]:
    """Every address of HOST:PORT, as gRPC targets (IPv6 in brackets)."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return sorted({f"[{i[4][0]}]:{port}" if i[0] == socket.AF_INET6 else f"{i[4][0]}:{port}" for i in infos})


class Replicas:
    """`make_channel(address, authority)` opens a channel to one replica (authority: the DNS name
    the replica was found under, for TLS name checks; None for a fixed address)."""

    def __init__(self, target: str, make_channel: Callable[[str, str | None], grpc.aio.Channel], timeout_s: float = 2.0):
        self.target = target
        self.name, self.fixed = parse_target(target)
        self.make_channel, self.timeout_s = make_channel, timeout_s
        self.replicas: dict[str, Replica] = {}
        self._leaving: list[Replica] = []  # gone from the name, sessions still open (an address may leave twice)
        self._turn = itertools.count()

    async def _addresses(self) -> list[str] | None:
        """The addresses now; None if the name does not resolve (keep the last ones meanwhile)."""
        if self.name is None:
            return self.fixed
        try:
            return await resolve(self.name)
        except (OSError, ValueError) as e:
            log.warning("verify name does not resolve", extra={"fields": {"verify": self.target, "error": str(e)}})
            return None

    async def refresh(self) -> None:
        """Resolves the replicas again and asks each for its Info. A replica that left the name
        (a verify pod that is terminating leaves DNS at once) takes no new sessions, and its
        channel is closed only once this draft's sessions there have ended, so they drain."""
        addresses = await self._addresses()
        if addresses is not None:
            authority = self.name.rpartition(":")[0] if self.name else None
            for a in addresses:
                if a not in self.replicas:
                    self.replicas[a] = Replica(a, self.make_channel(a, authority))
            for a in set(self.replicas) - set(addresses):
                self._leaving.append(self.replicas.pop(a))
        drained = [r for r in self._leaving if r.open == 0]
        self._leaving = [r for r in self._leaving if r.open]
        for r in drained:
            await r.channel.close()
            if r.address not in self.replicas:
                adaptive.PACES.pop(r.address, None)  # a pod's address is not reused for long: no pace kept for every one ever seen
        await asyncio.gather(*(self._poll(r) for r in list(self.replicas.values())))

    def pace(self, r: Replica) -> adaptive.Pace:
        """The pace of a session placed on `r`: the one its replica's sessions share while `r` is
        listed; one of its own, not kept, once `r` has left (its shared pace goes when it drains,
        and a session placed just before must not bring it back for good)."""
        return adaptive.pace_of(r.address) if self.replicas.get(r.address) is r else adaptive.Pace()

    async def _poll(self, r: Replica) -> None:
        try:
            open_now = r.open
            r.info = await r.stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
            r.reachable, r.error, r.open_at_poll = True, None, open_now
        except grpc.aio.AioRpcError as e:
            r.reachable, r.error = False, e

    @property
    def ready(self) -> bool:
        return any(r.reachable for r in self.replicas.values())

    def refusal(self, *codes: grpc.StatusCode) -> grpc.aio.AioRpcError | None:
        """An Info that a replica refused with one of `codes` (default: for this draft's credentials), if any."""
        codes = codes or (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        return next((r.error for r in self.replicas.values() if r.error is not None and r.error.code() in codes), None)

    def best(self) -> Replica | None:
        """The replica for a call that is not a session (calibration, a pairing check)."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def ranked(self, fingerprint: str | None = None, tree_budget: int = 0, text_rules: str = "", context: int = 0) -> list[Replica]:
        """Reachable replicas first, most free sessions first, ties in turn; then the others (an
        Info poll can miss a replica that is up: a session may still find it). With a session's
        needs: only replicas whose last Info says they serve it (the vocabulary `fingerprint` and
        the tokenizer's `text_rules`, where both sides report them; trees of `tree_budget` nodes; a
        context of at least `context`, the limit requests were checked against),
        so during a rolling change of replicas a session never goes to one that would refuse it,
        serve it another tokenizer's way, or (a verifier older than trees) read its tree as a chain."""
        rs = [r for r in self.replicas.values() if r.info is None or fingerprint is None or
              (r.info.vocab_fingerprint == fingerprint and r.info.max_tree_budget >= tree_budget
               and (not text_rules or not r.info.tokenizer.text_rules or r.info.tokenizer.text_rules == text_rules)
               and r.info.max_context >= context)]
        if not rs:
            return []
        k = next(self._turn) % len(rs)
        rs = rs[k:] + rs[:k]
        return sorted(rs, key=lambda r: (not r.reachable, -r.free_sessions))

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.25) -> bool:
        """Polls until a replica answers, for at most timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.refresh()
            if self.ready or self.refusal() is not None or loop.time() >= deadline:
                return self.ready
            await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))

    async def close(self) -> None:
        for r in [*self.replicas.values(), *self._leaving]:
            await r.channel.close()
        self.replicas.clear()
        self._leaving.clear()
