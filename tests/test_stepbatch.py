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
