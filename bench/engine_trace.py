"""A seeded synthetic serving trace, and a minimal scheduler that drives vLLM's BlockPool with it.

The trace (``make_trace``) is a list of requests fixed in advance from a seed: arrival step,
prompt (a recent request's whole conversation, i.e. a follow-up turn; else one of a few long
shared system prompts, picked with Zipf weights; else nothing; then a short unique tail) and
output tokens, and every full block's prefix-chained hash (vLLM's ``hash_block_tokens``
with SHA-256 of the pickle, computed here once, not per run: hashing tokens is the
engine's work, not the block pool's).

``Scheduler`` replays it the way vLLM's KV-cache manager uses the pool (full attention, one
KV-cache group, prefix caching on), one scheduler step at a time:

1. finished requests are freed: ``free_blocks(reversed(blocks))``, so blocks with a hash go
   to the back of the free queue (``append_n``) and blocks without one to the front
   (``prepend_n``);
2. every running request decodes one token: the free count is checked for it (vLLM's
   ``allocate_slots`` reads ``get_num_free_blocks()`` for every request, every step); a
   request whose blocks are full first gets one block (``get_new_blocks(1)``: the decode
   case); a block that becomes full is registered in the prefix cache (``cache_full_blocks``);
3. waiting requests are admitted first come, first served while a batch slot is free and
   the pool can hold them to completion: the longest cached prefix is looked up block by
   block (``get_cached_block``), taken (``touch``: a cached block that was free leaves the
   middle of the queue, ``remove``), the rest of the prompt gets new blocks (``get_new_blocks(n)``,
   evicting the least recently used cached blocks once the pool is full), and the prompt's
   full blocks are cached.

Every run over the same trace makes the same calls whatever the queue, as long as the queue
behaves like vLLM's: ``Scheduler(..., record=True)`` logs per step the block ids handed out,
the blocks evicted from the prefix cache and the free count, for the equivalence test.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

from engine_pool import Engine, vllm_sha256

__all__ = (
    "DECODE_HEAVY",
    "PREFIX_HEAVY",
    "TRACES",
    "QueueLog",
    "Request",
    "Scheduler",
    "Trace",
    "TraceParams",
    "make_trace",
    "replay_queue_ops",
)


@dataclass(frozen=True)
class TraceParams:
    name: str
    seed: int
    num_blocks: int  # pool size, null block included
    block_size: int
    steps: int  # scheduler steps run
    warmup_steps: int  # the first steps fill the pool; timings start after them
    arrivals_per_step: float  # Poisson mean
    max_running: int  # batch slots
    num_system_prompts: int
    system_prompt_blocks: tuple[int, int]  # full blocks, inclusive range
    shared_fraction: float  # share of requests that start with a system prompt
    tail_tokens: tuple[int, int]  # unique prompt tail, inclusive range
    output_tokens: tuple[int, int]  # inclusive range
    followup_fraction: float  # share of requests that continue a recent conversation
    followup_window: int  # ... chosen among this many latest requests
    max_context_tokens: int  # a follow-up longer than this starts a new conversation
    vocab: int = 32000

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


DECODE_HEAVY = TraceParams(
    name="decode-heavy",
    seed=6,
    num_blocks=4096,
    block_size=16,
    steps=2500,
    warmup_steps=500,
    arrivals_per_step=0.25,
    max_running=128,
    num_system_prompts=4,
    system_prompt_blocks=(2, 8),
    shared_fraction=0.3,
    tail_tokens=(16, 128),
    output_tokens=(128, 1024),
    followup_fraction=0.2,
    followup_window=32,
    max_context_tokens=4096,
)

PREFIX_HEAVY = TraceParams(
    name="prefix-heavy",
    seed=6,
    num_blocks=4096,
    block_size=16,
    steps=1500,
    warmup_steps=300,
    arrivals_per_step=2.0,
    max_running=64,
    num_system_prompts=16,
    system_prompt_blocks=(16, 64),
    shared_fraction=0.9,
    tail_tokens=(8, 96),
    output_tokens=(8, 64),
    followup_fraction=0.4,
    followup_window=256,
    max_context_tokens=4096,
)

TRACES = {p.name: p for p in (DECODE_HEAVY, PREFIX_HEAVY)}


class Request:
    """What BlockPool reads of a vLLM Request, plus the scheduler's own state."""

    __slots__ = (
        "all_block_hashes",
        "all_token_ids",
        "arrival",
        "block_hashes",
        "blocks",
        "lora_request",
        "mm_features",
        "num_cached_blocks",
        "num_tokens",
        "prompt_len",
        "request_id",
        "reserved",
        "session_id",
        "total_len",
    )

    def __init__(
        self,
        request_id: str,
        arrival: int,
        tokens: list[int],
        prompt_len: int,
        all_block_hashes: list[bytes],
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.all_token_ids = tokens
        self.prompt_len = prompt_len
        self.total_len = len(tokens)
        self.all_block_hashes = all_block_hashes
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.session_id = None
        self.reset()

    def reset(self) -> None:
        self.block_hashes: list[bytes] = []
        self.blocks: list[Any] = []
        self.num_cached_blocks = 0
        self.num_tokens = 0
        self.reserved = 0


@dataclass
class Trace:
    params: TraceParams
    requests: list[Request]

    def reset(self) -> None:
        for request in self.requests:
            request.reset()


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def make_trace(params: TraceParams, engine: Engine) -> Trace:
    """The seeded request list of ``params``; hashes with ``engine``'s hash_block_tokens."""
    rng = random.Random(params.seed)
    hash_block_tokens = engine.kv_cache_utils.hash_block_tokens
    bs = params.block_size
    system_prompts = [
        [rng.randrange(params.vocab) for _ in range(bs * rng.randint(*params.system_prompt_blocks))]
        for _ in range(params.num_system_prompts)
    ]
    # System prompt i is picked with weight 1/(i+1): the unpopular ones go idle, and their
    # cached blocks are free (so a later hit takes them out of the middle of the queue).
    weights = [1 / (i + 1) for i in range(params.num_system_prompts)]
    requests: list[Request] = []
    for step in range(params.steps):
        for _ in range(_poisson(rng, params.arrivals_per_step)):
            prefix: list[int] = []
            if requests and rng.random() < params.followup_fraction:
                previous = rng.choice(requests[-params.followup_window :])
                if previous.total_len + params.tail_tokens[1] + params.output_tokens[1] <= (
                    params.max_context_tokens
                ):
                    prefix = previous.all_token_ids
            if not prefix and rng.random() < params.shared_fraction:
                prefix = rng.choices(system_prompts, weights)[0]
            tail = [rng.randrange(params.vocab) for _ in range(rng.randint(*params.tail_tokens))]
            output = [
                rng.randrange(params.vocab) for _ in range(rng.randint(*params.output_tokens))
            ]
            tokens = prefix + tail + output
            hashes: list[bytes] = []
            parent: bytes | None = None
            for start in range(0, len(tokens) - bs + 1, bs):
                parent = hash_block_tokens(vllm_sha256, parent, tokens[start : start + bs])
                hashes.append(parent)
            requests.append(
                Request(f"req-{len(requests)}", step, tokens, len(prefix) + len(tail), hashes)
            )
    return Trace(params, requests)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """The KV-cache side of vLLM's scheduler step, on one BlockPool."""

    def __init__(self, trace: Trace, pool: Any, *, record: bool = False) -> None:
        trace.reset()
        self.trace = trace
        self.pool = pool
        self.block_size = trace.params.block_size
        self.max_running = trace.params.max_running
        self.arrivals: deque[Request] = deque(trace.requests)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0
        self.step_no = 0
        self.record = record
        self.log: list[tuple[Any, ...]] = []  # per step, when recording
        self._events: list[tuple[Any, ...]] = []
        self.timed_stats: dict[str, int] = {}
        self.stats = {
            "admitted": 0,
            "finished": 0,
            "get_new_blocks": 0,
            "blocks_allocated": 0,
            "prefix_hit_blocks": 0,
            "prompt_full_blocks": 0,
            "evicted": 0,
            "freed": 0,
        }

    # -- the pool calls ------------------------------------------------------------------

    def _new_blocks(self, n: int) -> list[Any]:
        pool = self.pool
        if self.record:
            ahead = list(islice(pool.free_block_queue.iter_blocks_after(None), n))
            evicted = tuple(b.block_id for b in ahead if b.block_hash is not None)
            blocks: list[Any] = pool.get_new_blocks(n)
            ids = tuple(b.block_id for b in blocks)
            assert ids == tuple(b.block_id for b in ahead), (ids, ahead)
            self._events.append(("alloc", ids, evicted))
            self.stats["evicted"] += len(evicted)
        else:
            blocks = pool.get_new_blocks(n)
        self.stats["get_new_blocks"] += 1
        self.stats["blocks_allocated"] += n
        return blocks

    def step(self) -> None:
        pool = self.pool
        bs = self.block_size
        self.step_no += 1

        # 1. Free the requests that finished last step.
        still = []
        for req in self.running:
            if req.num_tokens >= req.total_len:
                pool.free_blocks(reversed(req.blocks))
                self.stats["freed"] += len(req.blocks)
                self.stats["finished"] += 1
                if self.record:
                    self._events.append(("free", tuple(b.block_id for b in req.blocks)))
                req.blocks = []
            else:
                still.append(req)
        self.running = still

        # 2. Decode one token per running request. Like vLLM's allocate_slots, check the free
        #    count for every request, whether or not it needs a block this step.
        for req in still:
            needs_block = req.num_tokens % bs == 0
            if needs_block > pool.get_num_free_blocks() - self.reserved + req.reserved:
                raise AssertionError("admission reserved this request's blocks")
            if needs_block:
                req.blocks.extend(self._new_blocks(1))
                req.reserved -= 1
                self.reserved -= 1
            req.num_tokens += 1
            if req.num_tokens % bs == 0:
                num_full = req.num_tokens // bs
                req.block_hashes.append(req.all_block_hashes[num_full - 1])
                pool.cache_full_blocks(req, req.blocks, req.num_cached_blocks, num_full, bs, 0)
                req.num_cached_blocks = num_full

        # 3. Admit arrivals, first come first served.
        arrivals = self.arrivals
        while arrivals and arrivals[0].arrival < self.step_no:
            self.waiting.append(arrivals.popleft())
        waiting = self.waiting
        while waiting and len(self.running) < self.max_running:
            req = waiting[0]
            hashes = req.all_block_hashes
            hits = []
            for block_hash in hashes[: (req.prompt_len - 1) // bs]:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None:
                    break
                hits.append(cached[0])
            prompt_blocks = _cdiv(req.prompt_len, bs)
            need = prompt_blocks - len(hits)
            future = _cdiv(req.total_len, bs) - prompt_blocks
            evictable = sum(1 for b in hits if b.ref_cnt == 0)
            if need + evictable + future > pool.get_num_free_blocks() - self.reserved:
                break
            waiting.popleft()
            pool.touch(hits)
            req.blocks = hits + self._new_blocks(need) if need else hits
            num_full = req.prompt_len // bs
            req.block_hashes = hashes[:num_full]
            pool.cache_full_blocks(req, req.blocks, len(hits), num_full, bs, 0)
            req.num_cached_blocks = num_full
            req.num_tokens = req.prompt_len
            req.reserved = future
            self.reserved += future
            self.running.append(req)
            self.stats["admitted"] += 1
            self.stats["prefix_hit_blocks"] += len(hits)
            self.stats["prompt_full_blocks"] += num_full
            if self.record:
                self._events.append(("touch", tuple(b.block_id for b in hits)))

        pool.get_usage()
        if self.record:
            self.log.append(
                (self.step_no, tuple(self._events), pool.get_num_free_blocks(), len(self.running))
            )
            self._events = []

    def run(self, steps: int) -> None:
        step = self.step
        for _ in range(steps):
            step()

    def timed_run(
        self, warmup: int, steps: int, clock: Callable[[], float] = time.perf_counter
    ) -> float:
        """Run ``warmup`` steps untimed, then ``steps`` timed ones; their seconds.

        ``self.timed_stats`` then holds the counters of the timed steps alone.
        """
        self.run(warmup)
        before = dict(self.stats)
        step = self.step
        start = clock()
        for _ in range(steps):
            step()
        elapsed = clock() - start
        self.timed_stats = {k: v - before[k] for k, v in self.stats.items()}
        return elapsed


# -- the queue's own share: record the calls a run makes, replay them alone --------------


class QueueLog:
    """A queue class factory that wraps ``queue_class`` and logs every call by block id."""

    def __init__(self, queue_class: type) -> None:
        self.queue_class = queue_class
        self.ops: list[tuple[str, Any]] = []
        self.num_blocks = 0

    def __call__(self, blocks: list[Any]) -> Any:
        self.num_blocks = len(blocks)
        return _LoggingQueue(self.queue_class(blocks), self.ops)


class _LoggingQueue:
    def __init__(self, queue: Any, ops: list[tuple[str, Any]]) -> None:
        self._q = queue
        self._ops = ops

    @property
    def num_free_blocks(self) -> int:
        self._ops.append(("num_free_blocks", None))
        n: int = self._q.num_free_blocks
        return n

    def popleft(self) -> Any:
        self._ops.append(("popleft", None))
        return self._q.popleft()

    def popleft_n(self, n: int) -> Any:
        self._ops.append(("popleft_n", n))
        return self._q.popleft_n(n)

    def remove(self, block: Any) -> None:
        self._ops.append(("remove", block.block_id))
        self._q.remove(block)

    def append(self, block: Any) -> None:
        self._ops.append(("append", block.block_id))
        self._q.append(block)

    def append_n(self, blocks: list[Any]) -> None:
        self._ops.append(("append_n", [b.block_id for b in blocks]))
        self._q.append_n(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        self._ops.append(("prepend_n", [b.block_id for b in blocks]))
        self._q.prepend_n(blocks)

    def iter_blocks_after(self, cursor: Any) -> Iterator[Any]:
        return self._q.iter_blocks_after(cursor)  # type: ignore[no-any-return]


_KINDS = {
    "num_free_blocks": 0,
    "popleft_n": 1,
    "remove": 2,
    "append_n": 3,
    "prepend_n": 4,
    "append": 5,
    "popleft": 6,
}


def replay_queue_ops(
    log: QueueLog,
    queue_class: type,
    block_class: type,
    clock: Callable[[], float],
    start_at: int = 0,
) -> tuple[float, float]:
    """Replay ``log``'s calls on a fresh ``queue_class`` over fresh blocks.

    The calls before ``start_at`` (e.g. the warm-up steps') run untimed first. The calls are
    made as the pool makes them (``queue.popleft_n(n)``, ``queue.num_free_blocks``), from a
    loop that branches on the call's kind.

    Returns (seconds for the calls, seconds for the same loop making no call), so that the
    difference is the queue's own time, method lookups and calls included.
    """
    blocks = [block_class(i) for i in range(log.num_blocks)]
    queue = queue_class(blocks)
    ops: list[tuple[int, Any]] = []
    for op, arg in log.ops:
        if op in ("remove", "append"):
            arg = blocks[arg]
        elif op in ("append_n", "prepend_n"):
            arg = [blocks[i] for i in arg]
        ops.append((_KINDS[op], arg))
    _replay(queue, ops[:start_at])
    ops = ops[start_at:]
    start = clock()
    _replay(queue, ops)
    elapsed = clock() - start
    start = clock()
    _replay_nothing(queue, ops)
    baseline = clock() - start
    return elapsed, baseline


def _replay(q: Any, ops: list[tuple[int, Any]]) -> None:
    for kind, arg in ops:
        if kind == 0:
            q.num_free_blocks  # noqa: B018
        elif kind == 1:
            q.popleft_n(arg)
        elif kind == 2:
            q.remove(arg)
        elif kind == 3:
            q.append_n(arg)
        elif kind == 4:
            q.prepend_n(arg)
        elif kind == 5:
            q.append(arg)
        elif kind == 6:
            q.popleft()


def _replay_nothing(q: Any, ops: list[tuple[int, Any]]) -> None:
    # The same branches, each storing a constant instead of calling the queue.
    last = -1
    for kind, _arg in ops:
        if kind == 0:
            last = 0
        elif kind == 1:
            last = 1
        elif kind == 2:
            last = 2
        elif kind == 3:
            last = 3
        elif kind == 4:
            last = 4
        elif kind == 5:
            last = 5
        elif kind == 6:
            last = 6
    del last
