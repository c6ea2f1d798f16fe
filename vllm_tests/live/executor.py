"""The stub model executor: vLLM's engine core runs it in place of a model on a device.

Named by its qualified name in ``distributed_executor_backend`` (``live.executor.StubExecutor``),
it is built by vLLM inside the engine-core process. It reports one full-attention KV cache spec
per layer of the config-only model and room for many blocks (``num_gpu_blocks_override`` sets
the pool's size), and answers every step at once with the sampled token of each request whose
prompt is fully computed: ``(last token + 1) % vocab``. So the outputs depend on the prompts
alone, never on which KV blocks the scheduler gave, and any change in them is the engine's.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

#: What ``determine_available_memory`` reports: far more than the pool's override needs.
AVAILABLE_BYTES = 1 << 34


class StubWorker:
    """What vLLM's executor methods reach through ``collective_rpc``: the model's side."""

    def __init__(self, executor: Executor) -> None:
        model = executor.model_config
        self.vocab = model.get_vocab_size()
        self.spec = FullAttentionSpec(
            block_size=executor.cache_config.block_size,
            num_kv_heads=model.get_total_num_kv_heads(),
            head_size=model.get_head_size(),
            dtype=torch.float32,
        )
        layers = model.hf_text_config.num_hidden_layers
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        # request id -> its tokens (prompt, then sampled), kept until the request finishes.
        self.tokens: dict[str, list[int]] = {}

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        return dict.fromkeys(self.layers, self.spec)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout: str, cp_kv_cache_interleave_size: int) -> None:
        return None

    def determine_available_memory(self) -> int:
        return AVAILABLE_BYTES

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def take_draft_token_ids(self) -> None:
        return None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def kvqueue_report(self) -> dict[str, Any]:
        """kvqueue as this process (the engine core) sees it: for ``collective_rpc``."""
        from vllm.v1.core import block_pool

        import kvqueue.vllm

        status = getattr(kvqueue.vllm, "status", None)  # None: no pool guard in this kvqueue
        return {
            "pid": os.getpid(),
            "installed": kvqueue.vllm.installed(),
            "status": status() if status is not None else None,
            "queue_name": repr(block_pool.FreeKVCacheBlockQueue),
            "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
        }

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        """One step: a token for each request whose scheduled tokens reach its end."""
        for request_id in scheduler_output.finished_req_ids:
            self.tokens.pop(request_id, None)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        request_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            tokens = self.tokens[request_id]
            done = computed[request_id] + scheduler_output.num_scheduled_tokens[request_id]
            if done >= len(tokens):
                tokens.append((tokens[-1] + 1) % self.vocab)
                sampled.append([tokens[-1]])
            else:  # a chunk of a longer prompt: nothing is sampled yet
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )


class StubExecutor(Executor):
    """vLLM's executor interface over one in-process :class:`StubWorker`."""

    def _init_executor(self) -> None:
        self.worker = StubWorker(self)

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
    ) -> Any:
        if isinstance(method, str):
            result = [getattr(self.worker, method)(*args, **(kwargs or {}))]
        else:
            result = [method(self.worker, *args, **(kwargs or {}))]
        if not non_block:
            return result
        future: Future[Any] = Future()
        future.set_result(result)
        return future

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self.worker.execute_model(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def check_health(self) -> None:
        return None
