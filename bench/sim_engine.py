"""The simulated engine core: vLLM's KV block pool and its step scheduler for prefill.

The HTTP side (`bench.sim`) hands each admitted request's prompt here and waits for its prefill.
What a router is judged on depends on both: which blocks are cached when a request is scheduled,
and how long it waits behind other prefills.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sim_events import EventPublisher


class BlockPool:
    """vLLM's KV block pool, as its KV cache manager runs it.

    `capacity` blocks in all. The blocks of running requests are pinned (referenced) and never
    evicted; when a request finishes, its blocks go to the free queue tail first (its last block
    first), so a prompt's head, which follow-ups share, is evicted last. Cached blocks in the free
    queue still hit; a hit takes a block out of the queue and pins it again. A new block comes from
    never-used space, else from the free queue's head: the least recently freed block is evicted.
    Blocks without a hash (a prompt's partial last block, generated tokens) are pinned but never
    cached. A block being computed is pinned but does not hit until `commit`: a request scheduled
    beside the one computing it computes it too, as in one vLLM step. A request that cannot get
    its blocks waits, as vLLM's scheduler keeps it waiting.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: dict[int, int] = {}  # pinned cached blocks -> requests holding each
        self._free: OrderedDict[int, None] = OrderedDict()  # unpinned cached blocks, eviction order
        self._computing: set[int] = set()  # pinned blocks not computed yet: they do not hit
        self._anonymous = 0  # pinned blocks without a hash
        self.evicted: list[int] = []  # cached blocks dropped since the owner last took them (KV events)

    @property
    def pinned(self) -> int:
        return len(self._refs) + self._anonymous

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks, at most `limit`, are cached (pinned or free) and computed."""
        matched = 0
        for block in itertools.islice(hashes, limit):
            if (block not in self._refs and block not in self._free) or block in self._computing:
                break
            matched += 1
        return matched

    def can_acquire(self, hashes: Sequence[int], anonymous: int) -> bool:
        """Whether the blocks a request needs fit beside what is pinned."""
        new = sum(1 for block in dict.fromkeys(hashes) if block not in self._refs)
        return len(self._refs) + self._anonymous + new + anonymous <= self.capacity

    def acquire(self, hashes: Sequence[int], anonymous: int, computed: int | None = None) -> None:
        """Pin a request's blocks (call when can_acquire holds), evicting free blocks as needed.
        Blocks from index `computed` on that were not cached are being computed (None: none are)."""
        for index, block in enumerate(hashes):
            if block in self._refs:
                self._refs[block] += 1
                continue
            if block in self._free:  # a hit on a free block: out of the queue, pinned again
                del self._free[block]
            else:
                self._make_room(1)
                if computed is not None and index >= computed:
                    self._computing.add(block)
            self._refs[block] = 1
        self._make_room(anonymous)
        self._anonymous += anonymous

    def commit(self, hashes: Sequence[int]) -> None:
        """These blocks are computed: from now on they hit."""
        self._computing.difference_update(hashes)

    def _make_room(self, blocks: int) -> None:
        while len(self._refs) + self._anonymous + len(self._free) + blocks > self.capacity and self._free:
            self.evicted.append(self._free.popitem(last=False)[0])

    def release(self, hashes: Sequence[int], anonymous: int) -> None:
        """A request finished: unpin its blocks, last first, into the free queue (a block left
        uncomputed, by a request that ended during its prefill, is dropped: it holds nothing)."""
        self._anonymous -= anonymous
        for block in reversed(hashes):
            refs = self._refs.get(block)
            if refs is None:
                continue
            if refs > 1:
                self._refs[block] = refs - 1
            else:
                del self._refs[block]
                if block in self._computing:
                    self._computing.discard(block)
                else:
                    self._free[block] = None

    def clear(self) -> None:
        """Forget every unpinned cached block (vLLM refuses to reset while requests hold blocks)."""
        self._free.clear()


@dataclass(slots=True)
class Prefill:
    """One request's prefill, from its admission to the last prompt token computed."""

    tokens: Sequence[int]
    hashes: list[int]  # the prompt's full blocks
    anonymous: int  # its other blocks (the partial last one)
    done: asyncio.Future[int]  # set to the cached tokens; cancelled when the client leaves
    computed_blocks: int = 0  # leading blocks computed (cached ones included)
    position: int = 0  # prompt tokens done (cached ones included)
    held: bool = False  # its blocks are pinned in the pool
    cached: int = 0  # prompt tokens found cached when it was admitted

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.position


class StepScheduler:
    """vLLM's scheduler for prefill: each step computes at most `budget` prompt tokens, first for
    requests already prefilling (oldest first), then for waiting ones admitted in arrival order
    while budget and KV blocks last (the head waits for blocks; nothing overtakes it). A request
    looks up the cache when admitted, so it hits only blocks computed by then. A step takes
    `s_per_token` per token it computes: throughput as one serialized prefill, interleaving as
    chunked prefill. Decode is not part of the steps (the simulator decodes concurrently)."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        budget: int,
        s_per_token: float,
        admitted: Callable[[int, int], None],
        events: EventPublisher | None,
    ) -> None:
        self.pool = pool
        self._block_size = block_size
        self._budget = budget
        self._s_per_token = s_per_token
        self._admitted = admitted  # (prompt tokens, cached tokens) of each admitted request: metrics
        self._events = events
        self._waiting: deque[Prefill] = deque()
        self._prefilling: list[Prefill] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def prefill(self, tokens: Sequence[int], hashes: list[int], anonymous: int) -> Prefill:
        """Queue a prompt and wait until it is prefilled; the returned prefill holds its blocks
        (`release` them when the request ends, however it ends)."""
        job = Prefill(tokens, hashes, anonymous, asyncio.get_running_loop().create_future())
        self._waiting.append(job)
        self.wake()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            await job.done
        except asyncio.CancelledError:
            self.release(job)
            raise
        return job

    def release(self, job: Prefill) -> None:
        """The request ended: unpin its blocks (once) and let waiting requests try again."""
        if job.held:
            job.held = False
            self.pool.release(job.hashes, job.anonymous)
            self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            step = self._plan()
            if not step:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(sum(take for _, take in step) * self._s_per_token)
            for job, take in step:
                if not job.done.done():
                    self._advance(job, take)

    def _plan(self) -> list[tuple[Prefill, int]]:
        """This step's work: (prefill, tokens) pairs within the budget."""
        self._prefilling = [job for job in self._prefilling if not job.done.done()]
        budget, step = self._budget, []
        for job in self._prefilling:
            if budget <= 0:
                break
            take = min(job.remaining, budget)
            budget -= take
            step.append((job, take))
        while budget > 0 and self._waiting:
            job = self._waiting[0]
            if job.done.done():  # the client left while it waited
                self._waiting.popleft()
                continue
            if not self.pool.can_acquire(job.hashes, job.anonymous):
                break
            self._waiting.popleft()
            self._admit(job)
            self._prefilling.append(job)
            take = min(job.remaining, budget)
            budget -= take
            step.append((job, take))
        return step

    def _admit(self, job: Prefill) -> None:
        """Look the prompt up and pin its blocks; like vLLM, at least its last token is computed."""
        size = self._block_size
        present = self.pool.match(job.hashes, len(job.hashes))  # a full hit's last block is still cached
        job.position = min(present, (len(job.tokens) - 1) // size) * size
        job.computed_blocks = present
        self.pool.acquire(job.hashes, job.anonymous, computed=present)
        job.held = True
        evicted, self.pool.evicted = self.pool.evicted, []
        if self._events is not None:
            self._events.removed(evicted)
        job.cached = job.position
        self._admitted(len(job.tokens), job.cached)

    def _advance(self, job: Prefill, take: int) -> None:
        """The step computed `take` more tokens of the prompt: commit the blocks it filled."""
        size = self._block_size
        job.position += take
        full = min(len(job.hashes), job.position // size)
        if full > job.computed_blocks:
            new = job.hashes[job.computed_blocks : full]
            self.pool.commit(new)
            if self._events is not None:  # reported as the engine does, after the step
                parent = job.hashes[job.computed_blocks - 1] if job.computed_blocks else None
                self._events.stored(new, parent, job.tokens[job.computed_blocks * size : full * size], size)
            job.computed_blocks = full
        if not job.remaining:
            self._prefilling.remove(job)
            job.done.set_result(job.cached)
