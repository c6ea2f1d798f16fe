"""Long seeded workloads on vLLM's own ``Scheduler``, no fault injected: three ways alike.

Run by ``test_soak.py`` in its own process, from the root of the installed line's own test
files (``sdist.tests_root``), whose ``tests/v1/core/utils.py`` builds the scheduler
(``create_scheduler``) and lends its request makers, with ``KVQUEUE_AUDIT_EVERY=1`` (every
step's holder audit reads every listing and checks the holder index against it).
``python soak.py WORKLOAD SEEDS STEPS`` prints one JSON object: per workload, seed and way
(``vllm``: vLLM alone, then ``cython`` and ``python`` under ``on_misuse="raise"``), the digest
of each step's ``SchedulerOutput``, the exception that stopped the run (if any), the pool's
free count once every request is done, and kvqueue's counts (repairs of the pool, findings of
the audit, every refusal, repair, finding or index rebuild of the process, audited steps,
the steps between the audit's full reads).

The scheduler is driven as vLLM's engine core drives it, synchronously: ``schedule()``, then
``update_from_output()`` with the model runner's output built here (a sampled token for each
request whose prompt is computed, speculative drafts accepted in part), then the drafter's
tokens (``update_draft_token_ids``). One seeded stream per workload and seed makes the
arrivals, the aborts (``finish_requests(..., FINISHED_ABORTED)``), the sampled tokens (EOS
stops some requests; ``max_tokens`` the others) and the drafts; the three ways consume it
alike as long as they schedule alike. After the last arrival the requests run to their end.

Workloads (each also has aborts and stops by EOS and by length):

* ``prefix``: prefix caching; prompts share a few prefixes; parallel sampling (2-4
  requests of one prompt); blocks to spare.
* ``preempt``: as ``prefix`` with few blocks and a small token budget: chunked prefills and
  preemptions (recompute), prefix hits on blocks evicted and reused.
* ``spec``: as ``preempt`` with 3 speculative tokens a step (ngram), part rejected.
* ``async``: as ``preempt`` under async scheduling (``AsyncScheduler``): each step
  scheduled before the previous step's output is in, as the engine's batch queue does.
* ``connector``: vLLM's test KV connector (``MockKVConnector``: 32 tokens of each prompt
  found outside, loaded synchronously), parallel sampling, preemptions; no prefix caching
  (the mock finds its 32 tokens past any local hit, more than some prompts have left).
* ``sliding``: a sliding-window attention cache (64 tokens) with prefix caching and
  preemptions: blocks out of the window freed while the request runs (lines whose
  ``create_scheduler`` takes ``kv_cache_spec``).
* ``hybrid``: two cache groups, full attention and a sliding window of 64 tokens, over one
  pool, prefix caching and preemptions (lines whose connector test helpers build it).
* ``mamba``: two cache groups, full attention and mamba (``mamba_cache_mode="align"``),
  prefix caching and preemptions (as ``hybrid``).

Each run also counts the requests scheduled with tokens already computed (prefix hits,
or the connector's), the preempted requests, the drafts scheduled and the cache groups, so
that a workload shows it does what it is named for.

Not covered: speculative decoding under async scheduling (its drafts come back as
placeholders the model runner fills, ``update_draft_token_ids_in_output``), asynchronous
connector loads and delayed frees (the connector's output must then say which transfers
ended), a connector over a hybrid cache (the mock connector does not support it), and
multimodal or structured-output requests (their state is the encoder cache's and the
grammar's, not the block pool's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import random
import sys
import traceback
import warnings
from typing import Any

warnings.simplefilter("ignore")

import no_triton  # noqa: E402
import torch  # noqa: E402
from tests.v1.core import utils  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import kvqueue.vllm  # noqa: E402
from kvqueue.vllm import _report  # noqa: E402

BLOCK = 16
ABORTED = RequestStatus.FINISHED_ABORTED
EOS = utils.EOS_TOKEN_ID
# Steps that drain the requests left after the last arrival may take at most (a bound that
# a scheduler making progress never meets).
DRAIN = 2000
OUTPUT_FIELDS = {field.name for field in dataclasses.fields(ModelRunnerOutput)}
# Few enough blocks that the requests of most steps do not all fit: preemptions.
SMALL = {"enable_prefix_caching": True, "num_blocks": 48, "max_num_batched_tokens": 128}


def takes(function: Any, *names: str) -> str | None:
    """Why ``function`` cannot be called with ``names`` on this line (None: it can)."""
    missing = [name for name in names if name not in inspect.signature(function).parameters]
    if missing:
        return f"this line's {function.__name__} takes no {', '.join(missing)}"
    return None


def connector() -> dict[str, Any]:
    from tests.v1.kv_connector.unit.utils import MockKVConfig

    return {"use_kv_connector": MockKVConfig(matched_tokens=2 * BLOCK, is_async=False)}


def sliding() -> dict[str, Any]:
    # vLLM's own spec (the test helper that makes one is new in 0.34), shaped as
    # create_scheduler shapes its full-attention one.
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                             dtype=torch.float32, sliding_window=4 * BLOCK)  # fmt: skip
    return {"kv_cache_spec": spec}


def hybrid(check: bool = False, mamba: bool = False) -> Any:
    """A scheduler over two cache groups, full attention and a sliding window of 64 tokens
    (``mamba``: mamba), built by the line's connector test helpers (``create_scheduler`` of
    ``tests/v1/core/utils.py`` builds one group), without a connector. ``check``: why the
    line cannot build it (None: it can)."""
    from tests.v1.kv_connector.unit import utils as helpers

    if check:
        groups = ("mamba_enabled", "mamba_cache_mode") if mamba else ("swa_enabled", "sw_size")
        return takes(helpers.create_vllm_config, "kv_connector", "kv_role") or takes(
            helpers.make_kv_cache_config, *groups
        )
    config = helpers.create_vllm_config(
        max_num_batched_tokens=128, block_size=BLOCK, kv_connector="MockKVConnector",
        kv_role="kv_both", kv_connector_extra_config={"matched_tokens": 0, "is_async": False},
    )  # fmt: skip
    # No connector after all, and the hybrid manager on (the mock's presence turned it off),
    # as vLLM's hybrid connector tests turn it on again.
    config.kv_transfer_config = None
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    blocks = 48 if mamba else 96
    if mamba:
        config.cache_config.mamba_cache_mode = "align"
        caches = helpers.make_kv_cache_config(
            BLOCK, mamba_enabled=True, num_blocks=blocks, mamba_cache_mode="align"
        )
    else:
        caches = helpers.make_kv_cache_config(
            BLOCK, swa_enabled=True, sw_size=4 * BLOCK, num_blocks=blocks
        )
    return helpers.create_scheduler(config, num_blocks=blocks, kv_cache_config=caches)


def core(make: Any = dict, needs: tuple[str, ...] = (), **arguments: Any) -> Any:
    """A maker of ``tests/v1/core/utils.py``'s scheduler: ``arguments`` and what ``make``
    returns (the arguments named ``needs``: made when called, from vLLM's test modules);
    with ``check=True``, why the line's ``create_scheduler`` cannot build it (None: it can)."""

    def build(check: bool = False) -> Any:
        if check:
            return takes(utils.create_scheduler, *arguments, *needs)
        return utils.create_scheduler(**arguments, **make())

    return build


# name: (what builds the scheduler; the stream's shape)
WORKLOADS: dict[str, tuple[Any, dict[str, Any]]] = {
    "prefix": (
        core(enable_prefix_caching=True, num_blocks=400, max_num_batched_tokens=512),
        {"spec": 0, "min_prompt": 1},
    ),
    "preempt": (core(**SMALL), {"spec": 0, "min_prompt": 1}),
    "spec": (
        core(**{**SMALL, "num_blocks": 56}, num_speculative_tokens=3),
        {"spec": 3, "min_prompt": 1},
    ),
    "async": (core(**SMALL, async_scheduling=True), {"spec": 0, "min_prompt": 1, "async": True}),
    "connector": (
        core(
            connector,
            ("use_kv_connector",),
            enable_prefix_caching=False,
            num_blocks=64,
            max_num_batched_tokens=256,
        ),
        {"spec": 0, "min_prompt": 3 * BLOCK},
    ),
    "sliding": (
        core(sliding, ("kv_cache_spec",), **{**SMALL, "num_blocks": 40}),
        {"spec": 0, "min_prompt": 1},
    ),
    "hybrid": (hybrid, {"spec": 0, "min_prompt": 1}),
    "mamba": (lambda check=False: hybrid(check, mamba=True), {"spec": 0, "min_prompt": 1}),
}


class Stream:
    """The seeded requests, aborts, tokens and drafts of one run."""

    def __init__(self, seed: int, shape: dict[str, Any]) -> None:
        self.rng = random.Random(seed)
        self.shape = shape
        self.prefixes = [
            [self.rng.randrange(1, 30000) for _ in range(self.rng.randrange(8, 6 * BLOCK))]
            for _ in range(4)
        ]
        self.made = 0
        utils.create_requests(1)  # vLLM's test helper sets the hash of no parent, once
        self.hasher = utils.get_request_block_hasher(BLOCK, utils.sha256)

    def request(self, name: str, prompt: list[int], max_tokens: int) -> Any:
        params = utils.SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        return utils.Request(request_id=name, prompt_token_ids=prompt, sampling_params=params,
                             pooling_params=None, mm_features=None,
                             block_hasher=self.hasher)  # fmt: skip

    def arrivals(self) -> list[Any]:
        """0-3 groups of requests; a group shares its prompt (parallel sampling)."""
        rng = self.rng
        made = []
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2))):
            prefix = rng.choice(self.prefixes) if rng.random() < 0.7 else []
            suffix = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 3 * BLOCK))]
            prompt = (prefix + suffix)[: 12 * BLOCK]
            while len(prompt) < self.shape["min_prompt"]:
                prompt.append(rng.randrange(1, 30000))
            group = rng.choice((1, 1, 1, 2, 3, 4))
            for _ in range(group):
                made.append(self.request(f"r{self.made}", prompt, rng.randrange(1, 6 * BLOCK)))
                self.made += 1
        return made

    def aborts(self, live: list[str]) -> list[str]:
        return [self.rng.choice(live)] if live and self.rng.random() < 0.08 else []

    def sampled(self, drafts: list[int]) -> list[int]:
        """The tokens of one decoding step: a run of the drafts accepted, then one sampled."""
        rng = self.rng
        accepted = drafts[: rng.randrange(len(drafts) + 1)]
        return [*accepted, EOS if rng.random() < 0.03 else rng.randrange(1, 30000)]

    def drafts(self) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(self.shape["spec"])]


def digest(output: Any) -> str:
    """A short hash of what a step scheduled: the tokens per request, the blocks given to
    new and to running or resumed requests, the drafts, the preempted and finished ids."""
    cached = output.scheduled_cached_reqs
    running = zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True)
    seen = {
        "tokens": sorted(output.num_scheduled_tokens.items()),
        "new": [
            (r.req_id, r.num_computed_tokens, [list(g) for g in r.block_ids])
            for r in output.scheduled_new_reqs
        ],
        "cached": [
            (name, computed, None if ids is None else [list(g) for g in ids])
            for name, computed, ids in running
        ],
        "drafts": sorted((k, list(v)) for k, v in output.scheduled_spec_decode_tokens.items()),
        "preempted": sorted(getattr(output, "preempted_req_ids", None) or ()),
        "finished": sorted(output.finished_req_ids),
    }
    text = json.dumps(seen, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_output(names: list[str], tokens: list[list[int]]) -> Any:
    """The model runner's output: ``tokens[i]`` sampled for request ``names[i]``."""
    fields = {"req_ids": names, "sampled_token_ids": tokens, "logprobs": None,
              "prompt_logprobs_dict": {}, "pooler_output": []}  # fmt: skip
    if "req_id_to_index" in OUTPUT_FIELDS:
        fields["req_id_to_index"] = {name: i for i, name in enumerate(names)}
    return ModelRunnerOutput(**fields)


class Driver:
    """vLLM's engine core over one scheduler: synchronous, or (``pipelined``, async
    scheduling) one step ahead, each step scheduled before the previous one's output is
    in, as its batch queue does."""

    def __init__(self, scheduler: Any, stream: Stream, pipelined: bool) -> None:
        self.scheduler = scheduler
        self.stream = stream
        self.pipelined = pipelined
        self.pending: tuple[Any, Any] | None = None
        self.steps: list[str] = []
        self.preempted: set[str] = set()
        self.drafted = 0
        self.hits = 0

    def sampling(self, output: Any, placeholders: dict[str, int]) -> list[bool]:
        """Whether each scheduled request samples this step: its prompt (and what it had
        generated) computed once this step's tokens are; under async scheduling, as the
        scheduler tells by the placeholders it added for the step's tokens."""
        wanted = []
        for name in output.num_scheduled_tokens:
            request = self.scheduler.requests[name]
            if self.pipelined:
                wanted.append(request.num_output_placeholders > placeholders.get(name, 0))
                continue
            drafts = len(output.scheduled_spec_decode_tokens.get(name, ()))
            wanted.append(request.num_computed_tokens - drafts >= request.num_tokens)
        return wanted

    def step(self) -> None:
        scheduler, stream = self.scheduler, self.stream
        placeholders = (
            {name: r.num_output_placeholders for name, r in scheduler.requests.items()}
            if self.pipelined
            else {}
        )
        output = scheduler.schedule()
        self.steps.append(digest(output))
        self.preempted.update(getattr(output, "preempted_req_ids", None) or ())
        self.drafted += sum(map(len, output.scheduled_spec_decode_tokens.values()))
        self.hits += sum(1 for new in output.scheduled_new_reqs if new.num_computed_tokens)
        names = list(output.num_scheduled_tokens)
        drafts = output.scheduled_spec_decode_tokens
        sampling = zip(names, self.sampling(output, placeholders), strict=True)
        tokens = [stream.sampled(list(drafts.get(name, ()))) if samples else []
                  for name, samples in sampling]  # fmt: skip
        ran: tuple[Any, Any] | None = (output, model_output(names, tokens))
        if self.pipelined:
            ran, self.pending = self.pending, ran
        if ran is None:
            return
        scheduler.update_from_output(*ran)
        if stream.shape["spec"]:
            live = [name for name in names if name in scheduler.requests]
            scheduler.update_draft_token_ids(DraftTokenIds(live, [stream.drafts() for _ in live]))

    def flush(self) -> None:
        """The output of the step still running (async scheduling), handed to the scheduler."""
        if self.pending is not None:
            self.scheduler.update_from_output(*self.pending)
            self.pending = None


def run(workload: str, seed: int, steps_wanted: int) -> dict[str, Any]:
    build, shape = WORKLOADS[workload]
    scheduler = build()
    pool = scheduler.kv_cache_manager.block_pool
    stream = Stream(seed, shape)
    events_before = _report.events()
    findings_before = kvqueue.vllm.audit_findings()
    audited_before = kvqueue.vllm.audited_steps()
    driver = Driver(scheduler, stream, shape.get("async", False))
    result: dict[str, Any] = {}
    try:
        for _ in range(steps_wanted):
            for request in stream.arrivals():
                scheduler.add_request(request)
            if aborted := stream.aborts(sorted(scheduler.requests)):
                scheduler.finish_requests(aborted, ABORTED)
            driver.step()
        for _ in range(DRAIN):
            if not scheduler.has_unfinished_requests():
                break
            driver.step()
        driver.flush()
        result["unfinished"] = len(scheduler.requests)
        driver.step()  # the last frees' finished ids are handed out
        driver.flush()
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        result["raised"] = f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"
    result["steps"] = driver.steps
    result["requests"] = stream.made
    result["free"] = pool.get_num_free_blocks()
    result["blocks"] = pool.num_gpu_blocks
    result["preempted"] = len(driver.preempted)
    result["drafted"] = driver.drafted
    result["hits"] = driver.hits
    result["groups"] = len(scheduler.kv_cache_manager.coordinator.single_type_managers)
    result["repairs"] = {k: v for k, v in kvqueue.vllm.pool_repairs(pool).items() if v}
    result["findings"] = {
        k: n - findings_before[k] for k, n in kvqueue.vllm.audit_findings().items()
        if n > findings_before[k]
    }  # fmt: skip
    result["events"] = {
        "/".join(k): n - events_before.get(k, 0) for k, n in _report.events().items()
        if n > events_before.get(k, 0)
    }  # fmt: skip
    result["audited"] = kvqueue.vllm.audited_steps() - audited_before
    result["audit_every"] = kvqueue.vllm.status()["audit_every"]
    return result


def main() -> None:
    no_triton.allow()  # vLLM 0.34+ on an x86 CPU without triton-cpu: its config check only
    workloads, seeds, steps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    results: dict[str, Any] = {}
    for workload in workloads:
        why = WORKLOADS[workload][0](check=True)
        if why is not None:
            results[workload] = {"unsupported": why}
            continue
        for seed in range(seeds):
            for way in ("vllm", "cython", "python"):
                if way == "vllm":
                    kvqueue.vllm.uninstall()
                else:
                    kvqueue.vllm.install(way, on_misuse="raise")
                results[f"{workload}/{seed}/{way}"] = run(workload, seed, steps)
    kvqueue.vllm.uninstall()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
