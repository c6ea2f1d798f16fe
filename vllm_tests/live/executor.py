"""The stub model executor: vLLM's engine core runs it in place of a model on a device.

Named by its qualified name in ``distributed_executor_backend`` (``live.executor.StubExecutor``),
it is built by vLLM inside the engine-core process. It reports one full-attention KV cache spec
per layer of the config-only model and room for many blocks (``num_gpu_blocks_override`` sets
the pool's size), and keeps a real KV cache on the CPU: a tensor of ``num_blocks`` rows of
``block_size`` slots, indexed by the block ids the scheduler gives each request, as a model
runner's is. Each step writes every scheduled token into its slot (the request's block table
at that position), then computes each request's next token from what the cache holds for its
whole context (``model.next_token``): tokens a prefix-cache hit skips are read from the blocks
another request wrote. Right blocks give ``model.completion`` exactly; a block that two
requests hold at once gives one of them another request's tokens, and a wrong completion.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker import worker_base

from live import model

_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}

#: What ``determine_available_memory`` reports: far more than the pool's override needs.
AVAILABLE_BYTES = 1 << 34
#: What a KV slot holds before any step writes it: no token's id.
UNWRITTEN = -1


@dataclass
class Request:
    """What the worker keeps of a request between steps, as a model runner does."""

    #: Prompt, then every sampled token.
    tokens: list[int]
    #: The block table: ``block_ids[i]`` holds positions ``i * block_size`` onwards.
    block_ids: list[int]


class StubWorker:
    """What vLLM's executor methods reach through ``collective_rpc``: the model's side."""

    def __init__(self, executor: Executor) -> None:
        config = executor.model_config
        self.spec = FullAttentionSpec(
            block_size=executor.cache_config.block_size,
            num_kv_heads=config.get_total_num_kv_heads(),
            head_size=config.get_head_size(),
            dtype=torch.float32,
        )
        layers = config.hf_text_config.num_hidden_layers
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.block_size = executor.cache_config.block_size
        # Kept until the request finishes (a preempted request keeps its tokens).
        self.requests: dict[str, Request] = {}
        self.kv = torch.empty(0, dtype=torch.int64)
        # model.next_token, on what the cache holds.
        self.weights = torch.tensor(model.WEIGHTS, dtype=torch.int64)

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        return dict.fromkeys(self.layers, self.spec)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout: str, *since_033: Any) -> None:
        return None  # 0.33 adds the context-parallel interleave size

    def determine_available_memory(self) -> int:
        return AVAILABLE_BYTES

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        """The KV cache: one row of slots per block of the pool vLLM made."""
        (config,) = kv_cache_configs
        self.kv = torch.full((config.num_blocks, self.block_size), UNWRITTEN, dtype=torch.int64)

    def compile_or_warm_up_model(self) -> Any:
        # 0.18-0.19 take the warm-up's time as a float, later lines as CompilationTimes.
        times = getattr(worker_base, "CompilationTimes", None)
        return 0.0 if times is None else times(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def take_draft_token_ids(self) -> None:
        return None

    def supports_draft_weight_updates(self) -> bool:
        return False  # no draft model (0.30 asks at start-up)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def kvqueue_report(self) -> dict[str, Any]:
        """kvqueue as this process (the engine core) sees it: for ``collective_rpc``."""
        from vllm.v1.core import block_pool

        import kvqueue.vllm

        status = kvqueue.vllm.status()
        return {
            "pid": os.getpid(),
            "installed": status["implementation"],
            "status": status,
            "queue_name": repr(block_pool.FreeKVCacheBlockQueue),
            "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
        }

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        """One step: the scheduled tokens into the cache, then a token for each request whose
        scheduled tokens reach its end, computed from the cache."""
        computed = self._update(scheduler_output)
        # Copy-on-write copies the scheduler asks for (0.26+), before anything is written.
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            self.kv[copy.dst_block_id] = self.kv[copy.src_block_id]
        request_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            request = self.requests[request_id]
            start = computed[request_id]
            end = start + scheduler_output.num_scheduled_tokens[request_id]
            assert end <= len(request.tokens), "scheduled past the request's tokens"
            flat = self._slots(request, start, end)
            self.kv.view(-1)[flat] = torch.tensor(request.tokens[start:end], dtype=torch.int64)
            if end == len(request.tokens):
                context = self.kv.view(-1)[self._slots(request, 0, end)]
                token = int((context * self.weights[:end]).sum()) % model.VOCAB
                request.tokens.append(token)
                sampled.append([token])
            else:  # a chunk of a longer prompt: nothing is sampled yet
                sampled.append([])
        # vLLM 0.34 dropped req_id_to_index (the index is the position in req_ids).
        index = {"req_id_to_index": {request_id: i for i, request_id in enumerate(request_ids)}}
        return ModelRunnerOutput(
            req_ids=request_ids,
            sampled_token_ids=sampled,
            **(index if _HAS_INDEX else {}),
        )

    def _update(self, scheduler_output: Any) -> dict[str, int]:
        """Take in the step's requests and block tables; each one's computed tokens."""
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            (block_ids,) = new.block_ids  # one KV cache group
            known = self.requests.get(new.req_id)
            if known is not None:  # 0.34+: back from preemption, sent again as new
                known.block_ids = list(block_ids)
            else:
                self.requests[new.req_id] = Request(list(new.prompt_token_ids), list(block_ids))
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            request = self.requests[request_id]
            new_ids = cached.new_block_ids[i]
            # Back from preemption (before 0.34): a new table.
            if request_id in getattr(cached, "resumed_req_ids", ()):
                (block_ids,) = new_ids
                request.block_ids = list(block_ids)
            elif new_ids is not None:
                (block_ids,) = new_ids
                request.block_ids.extend(block_ids)
            computed[request_id] = cached.num_computed_tokens[i]
        return computed

    def _slots(self, request: Request, start: int, end: int) -> torch.Tensor:
        """The flat cache indices of positions ``start:end`` in the request's block table."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(request.block_ids, dtype=torch.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


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
