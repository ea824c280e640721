"""The draft's batched steps (draft_service/stepbatch.py): many sessions' steps in one pass of the
draft model, served in the order they were queued, so no session waits behind the others."""
import threading

import torch

from draft_service import stepbatch
from draft_service.stepbatch import StepBatcher
from specdec.engine import PREFILL_CHUNK
from specdec.lm import LM

SESSIONS = 4
STEPS = 40


def test_every_step_is_done_within_two_passes_and_a_prompt_chunk_in_its_turn(model_dir, monkeypatch):
    """Four sessions draft one-token steps without pause while a fifth prefills a prompt of three
    chunks. Counting, for every step, the passes that start while it waits in the queue (read
    from the queue itself as each pass starts: passes, not seconds, whatever the machine's speed
    or its threads' scheduling): a step waits for what was queued before it, so a session's own
    step is never held up while its thread runs passes for the others: at most the steps queued
    before a chunk and the chunk (2), then its own pass; and a thread that leads runs no pass
    once its own step is done. A prompt chunk runs after the steps queued before it (1). Every result is the session's own logits, as alone. (The leader that
    served everyone, as before, made a step wait 18-43 passes.)"""
    torch.set_num_threads(1)
    lm = LM.load(model_dir("long-draft"), "cpu", "float32")
    batcher = StepBatcher(lm.engine)
    engine_forward = lm.engine.forward
    waited: dict[int, int] = {}  # id(step) -> passes started while it was queued
    mine = threading.local()  # the steps a thread's current call queued

    class Step(stepbatch._Step):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            waited[id(self)] = 0
            mine.steps.append(self)

    served = []  # passes a thread ran for the others once its own call's step was done

    def counted(*args, **kwargs):
        with batcher._cv:  # this pass's steps have left the queue: what is still there waits through it
            for s in batcher._waiting:
                waited[id(s)] += 1
        if getattr(mine, "steps", None) and mine.steps[-1].done:
            served.append(1)
        return engine_forward(*args, **kwargs)

    monkeypatch.setattr(stepbatch, "_Step", Step)
    lm.engine.forward = counted
    waits: dict[str, list[int]] = {"step": [], "chunk": []}
    checked: dict[int, torch.Tensor] = {}

    def timed(kind: str, fn, *args):
        mine.steps = []
        out = fn(*args)
        assert len(mine.steps) == 1
        waits[kind].append(waited[id(mine.steps[0])])
        return out

    def session(k: int):
        cache = lm.engine.cache(STEPS + 4)
        timed("step", batcher.forward, cache, [3 + k, 4])
        for i in range(STEPS):
            tok = 5 + (k + i) % 7
            got = timed("step", batcher.forward, cache, [tok])
            if i == STEPS // 2:
                checked[k] = got
        cache.release()

    def prompt():
        cache = lm.engine.cache(3 * PREFILL_CHUNK + 1)
        ids = [(7 * i) % 13 + 2 for i in range(3 * PREFILL_CHUNK)]
        for start in range(0, len(ids), PREFILL_CHUNK):
            timed("chunk", batcher.forward, cache, ids[start : start + PREFILL_CHUNK], False)
        cache.release()

    threads = [threading.Thread(target=session, args=(k,)) for k in range(SESSIONS)] + [threading.Thread(target=prompt)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert len(waits["step"]) == SESSIONS * (STEPS + 1) and len(waits["chunk"]) == 3
    assert not served, f"{len(served)} passes run by a thread whose own step was done"
    assert max(waits["step"]) <= 2, sorted(waits["step"])[-5:]
    assert max(waits["chunk"]) <= 1, waits["chunk"]
    for k, got in checked.items():  # the same context run alone, once the sessions are done
        ref = lm.engine.cache(STEPS + 4)
        want = engine_forward([[3 + k, 4] + [5 + (k + j) % 7 for j in range(STEPS // 2 + 1)]], [ref])[0][-1]
        ref.release()
        assert torch.equal(got, want), k


def test_the_draft_services_executor_lets_every_session_draft_at_once():
    """Drafting threads came from asyncio's default executor, min(32, CPUs + 4) workers: on this
    2-core host 6 sessions drafted at once, so the step batcher never batched more, whatever
    --max-sessions allowed. 20 drafting threads that each wait for all the others meet only where
    the executor has a worker for each (they time out on the default one)."""
    import asyncio
    import threading

    from draft_service.decode import drafting_executor, started

    async def meet(n: int) -> list[int]:
        asyncio.get_running_loop().set_default_executor(drafting_executor(n))
        barrier = threading.Barrier(n, timeout=20)
        return await asyncio.gather(*(started(barrier.wait) for _ in range(n)))

    assert sorted(asyncio.run(meet(20))) == list(range(20))


def test_a_step_that_fails_fails_its_own_session_only(model_dir):
    """A pass of four sessions' steps, one of which overflows its cache: the exception went to all
    four. The pass is retried a step at a time (a failed pass commits nothing), so the other three
    get their own logits, as alone."""
    import pytest

    from specdec.engine import KVCache

    torch.set_num_threads(1)
    lm = LM.load(model_dir("draft"), "cpu", "float32")
    batcher = StepBatcher(lm.engine)
    caches = [KVCache(16) for _ in range(4)]
    for i, c in enumerate(caches):
        lm.engine.forward([[3 + i] * (15 if i == 2 else 4)], [c], [False])  # the third is one token from full
    alone = [KVCache(16) for _ in range(4)]
    want = []
    for i, c in enumerate(alone):
        if i != 2:
            lm.engine.forward([[3 + i] * 4], [c], [False])
            want.append(lm.engine.forward([[9, 10]], [c], [True])[0][-1])
    steps = [stepbatch._Step(c, [9, 10], True) for c in caches]  # two tokens: past the third's room
    batcher._waiting = list(steps)
    batcher._pass()
    assert all(s.done for s in steps)
    with pytest.raises(ValueError, match="cache overflow"):
        raise steps[2].error
    got = [s.result for i, s in enumerate(steps) if i != 2]
    assert all(s.error is None for i, s in enumerate(steps) if i != 2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert [c.length for c in caches] == [6, 6, 15, 6]  # the failed step's cache did not move
