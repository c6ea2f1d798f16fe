"""vLLM's own ``Scheduler`` on the CPU, driven step by step with a fake model, and the seeded
workloads it serves.

Built as vLLM's scheduler tests build it (a model directory holding only a ``config.json``), it
runs vLLM's real ``KVCacheManager`` and ``BlockPool``, whose queue is whatever
``vllm.v1.core.block_pool`` names when it is built (``kvqueue.vllm.install()`` rebinds it). The
fake model samples the next token of each request's fixed output, as vLLM's model runner does.
A workload is drawn in advance from a seed, whatever the queue: per request its arrival step,
its prompt (a recent request's whole conversation, i.e. a follow-up turn; else one of a few
shared system prompts, Zipf-weighted; else nothing; then a short unique tail) and its output,
fixed so that a follow-up hits the prefix cache the earlier request filled.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    num_blocks: int  # KV-cache blocks, the null block included
    block_size: int
    steps: int  # scheduler steps run
    warmup_steps: int  # the first steps fill the cache; timing starts after them
    arrivals_per_step: float  # Poisson mean
    max_num_seqs: int  # batch slots
    max_num_batched_tokens: int  # token budget per step (chunked prefill)
    num_system_prompts: int
    system_prompt_blocks: tuple[int, int]  # full blocks, inclusive range
    shared_fraction: float  # share of requests that start with a system prompt
    tail_tokens: tuple[int, int]  # unique prompt tail, inclusive range
    output_tokens: tuple[int, int]  # inclusive range
    followup_fraction: float  # share of requests that continue a recent conversation
    followup_window: int  # ... chosen among this many latest requests
    max_context_tokens: int  # a follow-up longer than this starts a new conversation
    vocab: int = 32000


DECODE_HEAVY = Workload(
    name="decode-heavy", seed=6, num_blocks=4096, block_size=16, steps=1200, warmup_steps=300,
    arrivals_per_step=0.25, max_num_seqs=128, max_num_batched_tokens=8192,
    num_system_prompts=4, system_prompt_blocks=(2, 8), shared_fraction=0.3,
    tail_tokens=(16, 128), output_tokens=(128, 1024),
    followup_fraction=0.2, followup_window=32, max_context_tokens=4096,
)  # fmt: skip
# The same engine, many short requests on popular long prompts.
PREFIX_HEAVY = replace(
    DECODE_HEAVY, name="prefix-heavy", steps=800, warmup_steps=200,
    arrivals_per_step=2.0, max_num_seqs=64,
    num_system_prompts=16, system_prompt_blocks=(16, 64), shared_fraction=0.9,
    tail_tokens=(8, 96), output_tokens=(8, 64),
    followup_fraction=0.4, followup_window=256,
)  # fmt: skip
WORKLOADS = {w.name: w for w in (DECODE_HEAVY, PREFIX_HEAVY)}


class Spec(NamedTuple):
    """One request of a workload: vLLM's ``Request`` is built from it when it arrives."""

    request_id: str
    arrival_step: int
    prompt: list[int]
    output: list[int]


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def make_workload(w: Workload) -> list[Spec]:
    """The seeded request list of ``w``, in arrival order. O(total tokens)."""
    rng = random.Random(w.seed)
    system_prompts = [
        [rng.randrange(w.vocab) for _ in range(w.block_size * rng.randint(*w.system_prompt_blocks))]
        for _ in range(w.num_system_prompts)
    ]
    # Prompt i is picked with weight 1/(i+1): unpopular ones go idle and their cached blocks
    # sit in the free queue until a later hit takes them out of its middle.
    weights = [1 / (i + 1) for i in range(w.num_system_prompts)]
    longest_turn = w.tail_tokens[1] + w.output_tokens[1]
    specs: list[Spec] = []
    for step in range(w.steps):
        for _ in range(_poisson(rng, w.arrivals_per_step)):
            prefix: list[int] = []
            if specs and rng.random() < w.followup_fraction:
                previous = rng.choice(specs[-w.followup_window :])
                conversation = previous.prompt + previous.output
                if len(conversation) + longest_turn <= w.max_context_tokens:
                    prefix = conversation
            if not prefix and rng.random() < w.shared_fraction:
                prefix = rng.choices(system_prompts, weights)[0]
            tail = [rng.randrange(w.vocab) for _ in range(rng.randint(*w.tail_tokens))]
            output = [rng.randrange(w.vocab) for _ in range(rng.randint(*w.output_tokens))]
            specs.append(Spec(f"req-{len(specs)}", step, prefix + tail, output))
    return specs


# A small Llama-shaped model: only its shape reaches the scheduler (max length, vocab).
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "max_position_embeddings": 8192, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MAX_MODEL_LEN = 8192


class Setup:
    """One workload's requests and vLLM config, made once for all its runs."""

    def __init__(self, w: Workload) -> None:
        import no_triton  # vllm_tests/, on the PYTHONPATH the Makefile sets
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        no_triton.allow()  # vLLM 0.34+ refuses an x86 CPU without triton-cpu (no kernel runs)
        self.workload = w
        self.specs = make_workload(w)
        self.outputs = {s.request_id: s.output for s in self.specs}
        # Removed with the setup, once its schedulers are gone.
        self._model = tempfile.TemporaryDirectory(prefix="kvqueue-sched-model-")
        model = self._model.name
        Path(model, "config.json").write_text(json.dumps(_MODEL_CONFIG))
        cache_config = CacheConfig(block_size=w.block_size, gpu_memory_utilization=0.9,
                                   cache_dtype="auto", enable_prefix_caching=True)  # fmt: skip
        cache_config.num_gpu_blocks = w.num_blocks
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                     dtype="float16", seed=0, max_model_len=MAX_MODEL_LEN),
            scheduler_config=SchedulerConfig(
                max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                is_encoder_decoder=False),
            cache_config=cache_config,
        )  # fmt: skip
        register_all_kvcache_specs(self.vllm_config)
        self.kv_spec = FullAttentionSpec(
            block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(w.block_size, hash_fn)


class Driver:
    """Runs a workload through a fresh scheduler, a step at a time. ``fingerprint`` hashes every
    step's scheduled requests, token counts and block ids, preemptions and finished requests:
    two runs with equal fingerprints did the same work. ``counters`` count the timed steps."""

    def __init__(self, setup: Setup) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self._request_class = Request
        self._sampling = SamplingParams
        self._output_class = ModelRunnerOutput
        # vLLM 0.34 dropped req_id_to_index (a request's index is its place in req_ids).
        self._has_index = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}
        self.setup = setup
        w, config = setup.workload, setup.vllm_config
        groups = [KVCacheGroupSpec(["layer"], setup.kv_spec)]
        kv_cache_config = KVCacheConfig(w.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=w.block_size,
            log_stats=True,
        )
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.next_spec = 0
        self.step_no = 0
        self.fingerprint = 0
        self.counters = {"scheduled_tokens": 0, "preempted": 0, "finished": 0, "admitted": 0}

    def _arrivals(self) -> None:
        specs = self.setup.specs
        while self.next_spec < len(specs) and specs[self.next_spec].arrival_step <= self.step_no:
            spec = specs[self.next_spec]
            self.next_spec += 1
            params = self._sampling(ignore_eos=True, max_tokens=len(spec.output))
            request = self._request_class(
                request_id=spec.request_id, prompt_token_ids=list(spec.prompt),
                sampling_params=params, pooling_params=None, arrival_time=float(self.step_no),
                block_hasher=self.setup.block_hasher)  # fmt: skip
            self.scheduler.add_request(request)

    def _model_output(self, out: Any) -> Any:
        requests = self.scheduler.requests
        req_ids = [r.req_id for r in out.scheduled_new_reqs]
        req_ids += out.scheduled_cached_reqs.req_ids
        outputs = self.setup.outputs
        sampled = [
            [] if requests[i].is_prefill_chunk else [outputs[i][requests[i].num_output_tokens]]
            for i in req_ids
        ]
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
        return self._output_class(
            req_ids=req_ids, **(index if self._has_index else {}),
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[])  # fmt: skip

    def _record(self, out: Any) -> None:
        new = [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        preempted = sorted(out.preempted_req_ids or ())
        finished = sorted(out.finished_req_ids)
        step = repr((new, list(zip(cached.req_ids, cached.new_block_ids, strict=True)),
                     sorted(out.num_scheduled_tokens.items()), preempted, finished))  # fmt: skip
        self.fingerprint = zlib.crc32(step.encode(), self.fingerprint)
        c = self.counters
        c["scheduled_tokens"] += out.total_num_scheduled_tokens
        c["preempted"] += len(preempted)
        c["finished"] += len(finished)
        c["admitted"] += len(new)

    def run(
        self, after_warmup: Callable[[], Any] = lambda: None, step_times: list[float] | None = None
    ) -> float:
        """The whole workload, the collector off, ``after_warmup()`` called after the warm-up;
        the thread CPU time inside ``schedule()`` and ``update_from_output()`` over the timed
        steps (building requests and the fake model's output outside it), each timed step's
        also appended to ``step_times`` when given."""
        scheduler, clock, elapsed = self.scheduler, time.thread_time, 0.0
        gc.collect()
        gc.disable()
        try:
            for _ in range(self.setup.workload.steps):
                if self.step_no == self.setup.workload.warmup_steps:
                    after_warmup()
                    elapsed = 0.0
                    self.counters = dict.fromkeys(self.counters, 0)
                self._arrivals()
                start = clock()
                out = scheduler.schedule()
                mid = clock()
                model_output = self._model_output(out)
                resumed = clock()
                scheduler.update_from_output(out, model_output)
                step = mid - start + clock() - resumed
                elapsed += step
                if step_times is not None and self.step_no >= self.setup.workload.warmup_steps:
                    step_times.append(step)
                self._record(out)
                self.step_no += 1
        finally:
            gc.enable()
        return elapsed
