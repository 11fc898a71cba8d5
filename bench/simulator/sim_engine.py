"""The simulator's engine: vLLM's KV block pool and its step scheduler, without a model.

Routers are judged on what the engine's cache keeps and on how long requests wait, and both
follow from how vLLM schedules: in steps, each computing at most a token budget, running
requests first (a decode token each, or their prefill's next chunk), then waiting ones in
arrival order while budget, running slots and KV blocks last. A step's duration grows with the
tokens it computes and with their context (attention), so a request's time to first token depends
on the prefills queued beside it, and decoding slows while long prompts prefill: that spread of
latencies is what sets the order in which a closed-loop client's sessions come back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.simulator.sim_events import EventPublisher

log = logging.getLogger(__name__)

# Told to every request in the engine, instead of a token index, when a step fails: its server
# answers 500 (or ends the stream) rather than waiting for tokens that will never come.
ENGINE_FAILED = -1


class BlockPool:
    """vLLM's KV block pool, as its KV cache manager runs it.

    `capacity` blocks in all. The blocks of running requests are pinned (referenced) and never
    evicted; when a request finishes, its blocks go to the free queue tail first (its last block
    first), so a prompt's head, which follow-ups share, is evicted last. Cached blocks in the free
    queue still hit; a hit takes a block out of the queue and pins it again. A new block comes from
    never-used space, else from the free queue's head: the least recently freed block is evicted.
    Blocks without a hash (a prompt's partial last block, generated tokens) are pinned but never
    cached.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: dict[int, int] = {}  # pinned cached blocks -> requests holding each
        self._free: OrderedDict[int, None] = OrderedDict()  # unpinned cached blocks, eviction order
        self._anonymous = 0  # pinned blocks without a hash
        self.evicted: list[int] = []  # cached blocks dropped since the owner last took them (KV events)

    @property
    def pinned(self) -> int:
        return len(self._refs) + self._anonymous

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks, at most `limit`, are cached (pinned or free)."""
        matched = 0
        for block in itertools.islice(hashes, limit):
            if block not in self._refs and block not in self._free:
                break
            matched += 1
        return matched

    def can_acquire(self, hashes: Sequence[int], anonymous: int) -> bool:
        """Whether these blocks fit beside what is pinned (free cached blocks may be evicted)."""
        new = sum(1 for block in dict.fromkeys(hashes) if block not in self._refs)
        return len(self._refs) + self._anonymous + new + anonymous <= self.capacity

    def acquire(self, hashes: Sequence[int], anonymous: int) -> None:
        """Pin blocks (call when can_acquire holds), evicting free blocks as needed."""
        for block in hashes:
            if block in self._refs:
                self._refs[block] += 1
                continue
            if block in self._free:  # a hit on a free block: out of the queue, pinned again
                del self._free[block]
            else:
                self._make_room(1)
            self._refs[block] = 1
        self._make_room(anonymous)
        self._anonymous += anonymous

    def _make_room(self, blocks: int) -> None:
        while len(self._refs) + self._anonymous + len(self._free) + blocks > self.capacity and self._free:
            self.evicted.append(self._free.popitem(last=False)[0])

    def release(self, hashes: Sequence[int], anonymous: int) -> None:
        """Unpin blocks, last first, into the free queue."""
        self._anonymous -= anonymous
        for block in reversed(hashes):
            refs = self._refs.get(block)
            if refs is None:
                continue
            if refs > 1:
                self._refs[block] = refs - 1
            else:
                del self._refs[block]
                self._free[block] = None

    def clear(self) -> None:
        """Forget every unpinned cached block (vLLM refuses to reset while requests hold blocks)."""
        self._free.clear()


@dataclass(frozen=True, slots=True)
class StepCost:
    """How long one engine step takes: `step_s`, plus `token_s` per token it computes, plus
    `pair_s` per (token, earlier token of its sequence) pair, attention's share, which grows with
    the context. Decode tokens count like prompt tokens."""

    step_s: float
    token_s: float
    pair_s: float

    def of(self, start: int, tokens: int) -> float:
        """The cost of computing `tokens` tokens of a sequence after its first `start`."""
        return tokens * self.token_s + (tokens * start + tokens * (tokens + 1) // 2) * self.pair_s


@dataclass(eq=False, slots=True)
class Request:
    """One request in the engine: its prompt, how far it got and which KV blocks it holds."""

    tokens: Sequence[int]  # the prompt
    hashes: list[int]  # its full blocks' hashes
    output_tokens: int
    emit: Callable[[int], None]  # told each output token's index as the step that made it ends
    cached: int = -1  # prompt tokens found cached when first scheduled; -1 until then
    external: int = 0  # leading prompt blocks pulled from a prefill server (a disaggregated serve)
    transferred: int = 0  # prompt tokens those blocks spared computing, once first scheduled
    computed: int = 0  # prompt tokens in the KV cache or scheduled into it, then one per output token
    generated: int = 0
    pinned: int = 0  # leading hashed blocks it holds
    anonymous: int = 0  # other blocks it holds: a partial last block, output tokens
    reported: int = 0  # leading hashed blocks known to be stored (hits, or reported after a step)
    scheduled: int = 0  # tokens it computes in the step being run
    ended: bool = False
    queued_at: float = 0.0  # when it reached the engine (the engine's clock)
    scheduled_at: float = 0.0  # when it was first scheduled: queued until then, prefilling after
    first_token_at: float = 0.0  # when the step that made its first output token ended
    adapter: str | None = None  # the LoRA adapter it runs with
    salt: str | None = None  # its cache_salt, which keys its first block

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.tokens) - self.computed)


class Engine:
    """One backend's scheduler over its block pool: `submit` a request; it ends by itself after
    its last output token, or by `finish` when its client leaves (its blocks go back either way)."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cost: StepCost,
        events: EventPublisher | None,
        on_admit: Callable[[Request], None],
        on_preempt: Callable[[], None],
        on_step: Callable[[int, Sequence[Request]], None] = lambda tokens, firsts: None,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int = 1,
        lora_load_s: float = 0.0,
        on_lora_load: Callable[[], None] = lambda: None,
    ) -> None:
        """`max_loras`: adapters the running batch holds at once (a waiting request of another is
        passed over, as vLLM's scheduler does); each adapter a step swaps into a slot, evicting the
        least recently used once they are full, makes it `lora_load_s` longer."""
        self.pool = pool
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._budget = max_num_batched_tokens
        self._cost = cost
        self._events = events
        self._on_admit = on_admit  # on a request's first scheduling (its `cached` is then known)
        self._on_preempt = on_preempt
        self._on_step = on_step  # after each step: the tokens it computed, the requests it gave a first token
        self._clock = clock
        self._max_loras = max_loras
        self._lora_load_s = lora_load_s
        self._on_lora_load = on_lora_load
        self.slots: OrderedDict[str, None] = OrderedDict()  # adapters in the slots, least recently used first
        self._swaps = 0  # adapters the planned step swapped in
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def submit(self, request: Request) -> None:
        request.queued_at = self._clock()
        self.waiting.append(request)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def finish(self, request: Request) -> None:
        """The request ended: unpin its blocks, once, and let waiting requests try again."""
        if request.ended:
            return
        request.ended = True
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._unpin(request)
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _unpin(self, request: Request) -> None:
        self.pool.release(request.hashes[: request.pinned], request.anonymous)
        request.pinned = request.anonymous = 0

    async def _run(self) -> None:
        """Run steps while there is work. A step that raises fails every request in the engine, as
        vLLM's dead engine core fails its server's requests; the next `submit` starts afresh."""
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "an engine step failed; failing the %d requests in the engine", len(self.running) + len(self.waiting)
            )
            for request in [*self.running, *self.waiting]:
                self.finish(request)
                request.emit(ENGINE_FAILED)

    async def _steps(self) -> None:
        while True:
            step = self.plan_step()
            if not step:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.duration(step))
            self.end_step(step)

    def duration(self, step: Sequence[Request]) -> float:
        """How long the planned step runs: its fixed part plus each request's tokens and context."""
        cost = self._cost.step_s + self._swaps * self._lora_load_s
        for request in step:
            cost += self._cost.of(request.computed - request.scheduled, request.scheduled)
        return cost

    def plan_step(self) -> list[Request]:
        """Plan one step as vLLM's scheduler does and return the requests it computes for. A
        scheduled request's `computed` already counts the step's tokens: vLLM caches a block when
        it schedules the block's tokens, so a request admitted later in the same step hits it."""
        budget, step = self._budget, []
        preempted = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:  # preempted for an earlier one in this loop
                continue
            take = min(request.prompt_left, budget) or 1  # a prefill chunk, else one decode token
            while not self._grow(request, request.computed + take):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request in self.running:
                budget -= self._schedule_tokens(request, take, step)
        adapters = {r.adapter for r in self.running if r.adapter is not None}
        passed: list[Request] = []  # waiting requests of an adapter no slot is left for
        while budget > 0 and self.waiting and not preempted and len(self.running) < self._max_num_seqs:
            request = self.waiting[0]
            if request.adapter is not None and request.adapter not in adapters and len(adapters) >= self._max_loras:
                passed.append(self.waiting.popleft())
                continue
            size, prompt = self._block_size, len(request.tokens)
            if not self.pool.can_acquire(request.hashes, -(-prompt // size) - len(request.hashes)):
                break  # vLLM admits a prompt only if all of it fits; the head waits, nothing overtakes it
            self.waiting.popleft()
            if request.adapter is not None:
                adapters.add(request.adapter)
            present = self.pool.match(request.hashes, len(request.hashes))
            held = max(present, min(request.external, len(request.hashes)))  # pulled blocks fill in after hits
            self.pool.acquire(request.hashes[:held], 0)
            request.pinned, request.reported = held, present  # pulled blocks are reported stored after the step
            last = (prompt - 1) // size  # the last prompt token is computed
            request.computed = min(held, last) * size
            if request.cached < 0:
                request.cached = min(present, last) * size
                request.transferred = request.computed - request.cached
                request.scheduled_at = self._clock()
                self._on_admit(request)
            take = min(request.prompt_left, budget)
            self._grow(request, request.computed + take)  # fits: the whole prompt did
            self.running.append(request)
            budget -= self._schedule_tokens(request, take, step)
        self.waiting.extendleft(reversed(passed))
        self._swaps = self._swap_in(step)
        evicted, self.pool.evicted = self.pool.evicted, []
        if self._events is not None:
            if step:
                self._events.step()  # what the engine queued (a cache clear) goes out with the step
            self._events.removed(evicted)
            if not step:
                self._events.publish()
        return step

    def _swap_in(self, step: Sequence[Request]) -> int:
        """Bring the step's adapters into the slots, least recently used out; how many came in."""
        swaps = 0
        for request in step:
            adapter = request.adapter
            if adapter is None:
                continue
            if adapter in self.slots:
                self.slots.move_to_end(adapter)
                continue
            if len(self.slots) >= self._max_loras:
                self.slots.popitem(last=False)
            self.slots[adapter] = None
            swaps += 1
            self._on_lora_load()
        return swaps

    def end_step(self, step: Sequence[Request]) -> None:
        """The step ran: report its stored blocks (also those of a request whose client left during
        the step: they were cached when it was planned), hand out its tokens, free what finished."""
        firsts = []
        for request in step:
            self._report(request)
            if request.ended:  # its client left during the step
                continue
            if request.prompt_left:
                continue
            request.generated += 1
            if request.generated == 1:
                request.first_token_at = self._clock()
                firsts.append(request)
            if request.generated >= request.output_tokens:
                self.finish(request)  # before the next step is planned, as vLLM frees it
            request.emit(request.generated - 1)
        if self._events is not None:
            self._events.publish()
        self._on_step(sum(request.scheduled for request in step), firsts)

    @staticmethod
    def _schedule_tokens(request: Request, take: int, step: list[Request]) -> int:
        """Put `take` tokens of the request into the step; return them, for the budget."""
        request.scheduled = take
        request.computed += take
        step.append(request)
        return take

    def _grow(self, request: Request, tokens: int) -> bool:
        """Hold the blocks of the sequence's first `tokens` tokens; False if they do not fit."""
        size = self._block_size
        full = min(len(request.hashes), tokens // size)  # hashed blocks whose tokens are all scheduled
        anonymous = max(0, -(-tokens // size) - max(full, request.pinned))
        hashes = request.hashes[request.pinned : full]
        more = anonymous - request.anonymous  # below 0 when a partial block became a full, hashed one
        if not self.pool.can_acquire(hashes, more):
            return False
        if more < 0:
            self.pool.release([], -more)
        self.pool.acquire(hashes, max(0, more))
        request.pinned, request.anonymous = max(full, request.pinned), anonymous
        return True

    def _preempt(self, request: Request) -> None:
        """vLLM's recompute preemption: the latest running request gives its blocks back and
        waits at the head of the queue to compute its prompt again."""
        self.running.remove(request)
        self._unpin(request)
        request.computed = 0
        request.external = 0  # what was pulled is now cached or gone; the rest is computed
        self._on_preempt()
        self.waiting.appendleft(request)

    def _report(self, request: Request) -> None:
        """Report the hashed blocks the step filled, as the engine does after it."""
        size = self._block_size
        last = min(len(request.hashes), request.computed // size)
        if last > request.reported and self._events is not None:
            first = request.reported
            parent = request.hashes[first - 1] if first else None
            tokens = request.tokens[first * size : last * size]
            self._events.stored(request.hashes[first:last], parent, tokens, size, first, request.adapter, request.salt)
        request.reported = max(request.reported, last)
