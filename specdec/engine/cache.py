"""One pooled, paged KV cache per model, and the sessions' handles into it.

The pool holds, per layer, one K and one V tensor [slots, H_kv, D] on the model's device, cut
into pages of PAGE token slots. A session's cache (`KVCache`) owns whole pages: as many as its
reservation needs (prompt + max_new_tokens + its tree budget, capped at the context), taken
once, at admission (`Pool.cache`) or at its first pass. A token's keys and values live at slot
page[pos // PAGE] * PAGE + pos % PAGE; a pass writes its new tokens there with one `index_copy_`
per layer, and reads a session's keys back through the same mapping (specdec/engine/layout.py, attention.py).
A rejection only moves the session's length back. Page 0 is the trash page: a pass's padding
rows write there and masked key positions read there, and nothing reads it unmasked.

The pool's tensors start as zeros and grow (doubling, up to `limit`) on the thread that runs the
passes, at the start of a pass (`fit`), every layer to the same size: the pages handed out when
the pass starts (sessions admitted meanwhile are not in it). Pages come back to a free list when a
cache is released or garbage-collected, and a cache takes a run of consecutive free pages where
there is one (`take`). Nothing is copied when sessions join, leave or share a pass.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

PAGE = 16  # token slots per page; a pass pads each session's keys to a multiple of it (layout.py)


class Pool:
    """The model's KV slots, handed out as pages (thread-safe: sessions come and go on other
    threads than the one that runs the passes)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []  # per layer [slots, H_kv, D]
        self.v: list[torch.Tensor] = []
        self._pages = 1  # pages handed out so far, the trash page 0 included
        self.size = 8 * PAGE  # slots every layer holds (`fit`); a layer made later is made at it
        self.limit: int | None = None  # the most slots growth doubles to (the verify's cache budget); a pass's own need passes it
        self._free: list[int] = []  # free pages, ascending (`take` alone changes it)
        self._back: list[int] = []  # pages given back since the last `take`
        self._stale: list[int] = []  # pages given back since the last `fit`: cleared there, before a pass may read them
        self._lock = threading.RLock()  # a finalizer may hand pages back from inside `take`

    def cache(self, capacity: int) -> "KVCache":
        """A session's cache with its pages taken now."""
        c = KVCache(capacity)
        c.bind(self)
        return c

    def take(self, n: int) -> list[int]:
        """n pages: the first run of n consecutive free ones if there is one (a session alone in
        its group then reads its keys as a view of the pool, layout.py: no gather), else the
        lowest free ones, then fresh ones past the end."""
        with self._lock:
            free = self._merged()
            start = next((i for i in range(len(free) - n + 1) if free[i + n - 1] - free[i] == n - 1), None)
            if start is not None:
                got = free[start : start + n]
                del free[start : start + n]
                return got
            got = free[:n]
            del free[:n]
            fresh = n - len(got)
            got += range(self._pages, self._pages + fresh)
            self._pages += fresh
            return got

    def _merged(self) -> list[int]:
        """The free list, sorted, with the pages given back since the last call (under the lock)."""
        back, self._back = self._back, []  # a finalizer that gives pages back meanwhile adds to the new list
        self._free = sorted(self._free + back)
        return self._free

    def give(self, pages: list[int]) -> None:
        with self._lock:
            self._back.extend(pages)
            self._stale.extend(pages)

    @property
    def slots(self) -> int:
        """Slots the tensors hold for every page handed out so far (a high-water mark, O(1))."""
        return self._pages * PAGE

    def held_slots(self) -> int:
        """Slots the tensors must hold for every page held now: up to the highest page not free (a
        sort of the free list: `fit` asks only where the high-water mark is past the layers)."""
        with self._lock:
            free = self._merged()
            top, i = self._pages, len(free) - 1
            while i >= 0 and free[i] == top - 1:
                top, i = top - 1, i - 1
            return top * PAGE

    def fit(self) -> int:
        """Grows every layer to hold the pages held now (doubling, up to `limit`); returns
        the slots they hold. Called on the passes' thread only, once at the start of each pass,
        after its caches are bound: pages taken meanwhile (on the event loop) are not in the pass,
        so no layer grows in the middle of a pass, nor in a CUDA graph's capture. A growth that
        fails (out of memory) leaves `size` as it was; the next call grows the layers still short.
        Pages given back since the last call are zeroed first: a new owner's masked key positions
        read them, and a masked weight of exactly 0 times a non-finite value its last owner left
        (an overflow) would be NaN in the attention's sum (SDPA; the CPU tier's kernel skips them)."""
        self._clear()
        # the pages held, not every page ever handed out: where memory refused the growth for a large session's
        # pages, the passes of the smaller sessions after it asked for that growth again, and failed
        if self.slots <= self.size or (need := self.held_slots()) <= self.size:
            return self.size
        size = max(need, min(2 * self.size, self.limit or 2 * self.size))  # doubling, up to the limit
        if self.limit and need > self.limit:  # a need past it (a probe's page beside a full budget): some room past
            size = max(size, min(2 * self.size, need + 8 * PAGE))  # it too, not a copy of every layer at each page more
        # every layer's new K and V are made before any is kept (out of memory: the pool as it was, every layer; a
        # layer replaced before a later one failed kept the new size while `size` and a CUDA graph's addresses did not)
        grown = {i: tuple(torch.zeros((size, *old.shape[1:]), dtype=old.dtype, device=old.device) for old in (self.k[i], self.v[i]))
                 for i in range(len(self.k)) if self.k[i].shape[0] < size}
        for i, (k, v) in grown.items():
            k[: self.k[i].shape[0]] = self.k[i]
            v[: self.v[i].shape[0]] = self.v[i]
            self.k[i], self.v[i] = k, v
        self.size = size
        return size

    def _clear(self) -> None:
        """Zeroes the pages given back since the last call, in every layer (one fill per tensor)."""
        with self._lock:
            stale, self._stale = self._stale, []
        stale = sorted({p for p in stale if p * PAGE < self.size})  # pages past the layers are zeros when they grow
        if not stale or not self.k:
            return
        with torch.inference_mode():
            slots = (torch.tensor(stale)[:, None] * PAGE + torch.arange(PAGE)).flatten().to(self.device, non_blocking=True)
            for t in self.k + self.v:
                t.index_fill_(0, slots, 0)

    def layer(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (K, V) [size, H_kv, D], made at its first pass; like [1, H_kv, T, D] gives the
        shape of a layer's keys. Called on the passes' thread only."""
        if len(self.k) == i:
            shape = (self.size, like.shape[1], like.shape[3])
            k, v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            self.k.append(k)
            self.v.append(v)
        return self.k[i], self.v[i]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copies the keys and values at slots src to slots dst, in every layer (one gather and one
        write per tensor: the sources are read before anything is written). A tree round keeps its
        accepted path this way (DESIGN.md §12). Called on the passes' thread only, after every pass:
        one without tree rounds returns before entering inference mode, which costs a pass ~15 us."""
        if not src or not self.k:
            return
        with torch.inference_mode():
            s, d = torch.tensor(src + dst, dtype=torch.long).to(self.device, non_blocking=True).split(len(src))
            for t in self.k + self.v:
                t.index_copy_(0, d, t.index_select(0, s))


class KVCache:
    """One session's pages in a pool: the tokens it holds are positions 0..length-1."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0  # tokens held
        self.pages: list[int] = []
        self.pool: Pool | None = None
        self._done = None

    def bind(self, pool: Pool) -> None:
        """Takes the pages for the whole capacity from `pool` (once)."""
        if self.pool is None:
            self.pool = pool
            self.pages = pool.take(-(-self.capacity // PAGE))
            self._done = weakref.finalize(self, pool.give, list(self.pages))  # pages go back when the cache is dropped

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def path_slots(self, base: int, rows: list[int]) -> tuple[list[int], list[int]]:
        """(from, to) slots that bring tree nodes stored at positions base + rows[d] (rows rising) to
        base + 1 + d, the positions of an accepted path after its root (Pool.move copies them)."""
        moves = [(base + r, base + 1 + d) for d, r in enumerate(rows) if r != 1 + d]
        return self.slots_of([a for a, _ in moves]), self.slots_of([b for _, b in moves])

    def slots_of(self, positions) -> list[int]:
        """The slots of the given positions."""
        return [self.pages[p // PAGE] * PAGE + p % PAGE for p in positions]

    def release(self) -> None:
        """Gives the pages back to the pool (the cache is empty and unbound after)."""
        if self._done is not None:
            self._done()  # pool.give, at most once
        self.pool, self.pages, self.length, self._done = None, [], 0, None

    def slots(self, start: int, stop: int) -> list[int]:
        """The slots of positions start..stop-1."""
        return self.slots_of(range(start, stop))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values of the tokens held, [H_kv, length, D] each (a copy), for tests and tools."""
        idx = torch.tensor(self.slots(0, self.length), dtype=torch.long, device=self.pool.device)
        return tuple(t[i].index_select(0, idx).transpose(0, 1) for t in (self.pool.k, self.pool.v))

    @property
    def layers(self) -> int:
        return len(self.pool.k) if self.pool is not None else 0

    def nbytes(self) -> int:
        """Bytes of pool this cache's pages take (0 before its first pass)."""
        if self.pool is None or not self.pool.k:
            return 0
        per_slot = sum(t[0].numel() * t.element_size() for t in self.pool.k + self.pool.v)
        return len(self.pages) * PAGE * per_slot


def available_memory_bytes(device: torch.device | None = None) -> int | None:
    """Free memory on `device`: the CUDA device's free memory, or the host's MemAvailable, no more
    than this process's memory cgroup leaves (a pod's limit: MemAvailable in a container is the
    node's, so the cache budget was sized by the node and a pod past its limit was killed)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            host = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        host = None
    room = cgroup_headroom_bytes()
    return room if host is None else host if room is None else min(host, room)


def cgroup_headroom_bytes(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroups leave under their limits: the least over its own and its
    ancestors' (a process in a child cgroup of a limited container), each limit less the usage net
    of inactive file cache (reclaimable: the checkpoint read at start-up is charged as such, as
    kubelet's working set leaves it out). v2: memory.max, memory.current, memory.stat's
    inactive_file; v1: memory.limit_in_bytes, memory.usage_in_bytes, total_inactive_file. None
    where no cgroup has a limit."""
    try:
        with open(membership) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    folders = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        # the cgroup and its ancestors; a container's namespace may show its own cgroup as the root
        folders += [(os.path.join(base, *parts[:k]), files) for k in range(len(parts), -1, -1)]
    rooms = []
    for folder, (limit_file, usage_file, inactive_key) in folders:
        try:
            with open(os.path.join(folder, limit_file)) as fh:
                limit = fh.read().strip()
            with open(os.path.join(folder, usage_file)) as fh:
                usage = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # no limit here (v1's is a huge number)
            continue
        inactive = 0
        try:
            with open(os.path.join(folder, "memory.stat")) as fh:
                inactive = next((int(v) for k, v in (ln.split() for ln in fh if ln.strip()) if k == inactive_key), 0)
        except (OSError, ValueError):
            pass
        rooms.append(max(0, int(limit) - max(0, usage - inactive)))
    return min(rooms) if rooms else None