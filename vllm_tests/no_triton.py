"""vLLM's configuration check on an x86 CPU without Triton, passed (vLLM 0.34+): nothing else.

From 0.34, ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires Triton
(triton-cpu)" when ``vllm.triton_utils.HAS_TRITON`` is false (0.33 only warned). No package
index this project uses serves triton-cpu (PyPI's ``triton`` is the CUDA build, which vLLM
disables on a CPU host), and nothing kvqueue's checks run needs it: vLLM's scheduler and block
pool tests run no kernel, and the live engine's model is a stub (live/executor.py). Without
this every test that builds a ``VllmConfig`` fails with vLLM's own queue (1,213 of 0.34's CPU
suites here). :func:`allow` makes that one check see Triton while it runs, nothing more; it is
applied alike whichever queue runs (vLLM's own, each twin), so the three ways stay comparable.
A line whose check does not raise for want of Triton is left as it is.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_MARK = "_kvqueue_no_triton"


def allow() -> bool:
    """Pass the installed vLLM's Triton check on the CPU; whether it had one to pass."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms import cpu

    found = vars(cpu.CpuPlatform).get("check_and_update_config")
    if not isinstance(found, classmethod) or getattr(found.__func__, _MARK, False):
        return False
    original = found.__func__
    if triton_utils.HAS_TRITON or "requires Triton" not in inspect.getsource(original):
        return False

    @functools.wraps(original)
    def check_and_update_config(cls: Any, vllm_config: Any) -> Any:
        triton_utils.HAS_TRITON = True
        try:
            return original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    setattr(check_and_update_config, _MARK, True)
    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
    return True
