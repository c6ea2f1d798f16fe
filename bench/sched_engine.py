"""vLLM's own ``Scheduler`` on the CPU, driven step by step with a fake model.

Built the way vLLM's scheduler tests build it (a model directory holding only a
``config.json``), so that ``schedule()`` and ``update_from_output()`` run vLLM's real
``KVCacheManager`` and ``BlockPool``, whose ``FreeKVCacheBlockQueue`` is whatever
``vllm.v1.core.block_pool`` names when the scheduler is built (``kvqueue.vllm.install()``
rebinds it). The fake model samples the next token of each request's fixed output
(sched_workload.Spec), nothing for a prefill chunk, as vLLM's model runner does; requests
stop at their output length (``ignore_eos``).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sched_workload import Spec, Workload

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# A small Llama-shaped model: only its shape reaches the scheduler (max length, vocab).
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "max_position_embeddings": 8192, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MAX_MODEL_LEN = 8192


def model_dir() -> str:
    """A directory holding only the model's config.json (made once per process)."""
    path = Path(tempfile.mkdtemp(prefix="kvqueue-sched-model-"))
    (path / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return str(path)


class SchedulerFactory:
    """Builds fresh vLLM schedulers for one workload; the config is built once."""

    def __init__(self, w: Workload, model: str) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec

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
        self.spec = FullAttentionSpec(
            block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        self.workload = w
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(w.block_size, hash_fn)

    def new(self) -> Any:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        kv_cache_config = KVCacheConfig(
            num_blocks=self.workload.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], self.spec)],
        )
        return Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.workload.block_size,
            log_stats=True,
        )


def block_pool(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool


class Driver:
    """Runs one workload through one scheduler, a step at a time. ``fingerprint`` hashes every
    step's scheduled requests, token counts and block ids, preemptions and finished requests:
    two runs with equal fingerprints did the same work."""

    def __init__(self, factory: SchedulerFactory, specs: list[Spec]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        self._request_class = Request
        self._sampling = SamplingParams
        self._output_class = ModelRunnerOutput
        self.factory = factory
        self.scheduler = factory.new()
        self.specs = specs
        self.outputs = {s.request_id: s.output for s in specs}
        self.next_spec = 0
        self.step_no = 0
        self.fingerprint = 0
        self.counters = {"scheduled_tokens": 0, "preempted": 0, "finished": 0, "admitted": 0}

    def _arrivals(self) -> None:
        specs = self.specs
        while self.next_spec < len(specs) and specs[self.next_spec].arrival_step <= self.step_no:
            spec = specs[self.next_spec]
            self.next_spec += 1
            params = self._sampling(ignore_eos=True, max_tokens=len(spec.output))
            request = self._request_class(
                request_id=spec.request_id, prompt_token_ids=list(spec.prompt),
                sampling_params=params, pooling_params=None, arrival_time=float(self.step_no),
                block_hasher=self.factory.block_hasher)  # fmt: skip
            self.scheduler.add_request(request)

    def _model_output(self, out: Any) -> Any:
        requests = self.scheduler.requests
        req_ids = [r.req_id for r in out.scheduled_new_reqs]
        req_ids += out.scheduled_cached_reqs.req_ids
        sampled = []
        for req_id in req_ids:
            r = requests[req_id]
            sampled.append(
                [] if r.is_prefill_chunk else [self.outputs[req_id][r.num_output_tokens]]
            )
        return self._output_class(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
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

    def run_workload(self, w: Workload, after_warmup: Callable[[], Any] = lambda: None) -> float:
        """The warm-up steps, ``after_warmup()``, then the timed steps (their time, as run()'s),
        the collector off."""
        gc.collect()
        gc.disable()
        try:
            self.run(w.warmup_steps)
            after_warmup()
            return self.run(w.steps - w.warmup_steps)
        finally:
            gc.enable()

    def run(self, steps: int) -> float:
        """The thread CPU time inside ``schedule()`` and ``update_from_output()`` over ``steps``
        steps (building requests and the fake model's output outside it)."""
        scheduler, clock = self.scheduler, time.thread_time
        elapsed = 0.0
        for _ in range(steps):
            self._arrivals()
            start = clock()
            out = scheduler.schedule()
            mid = clock()
            model_output = self._model_output(out)
            resumed = clock()
            scheduler.update_from_output(out, model_output)
            elapsed += mid - start + clock() - resumed
            self._record(out)
            self.step_no += 1
        return elapsed
