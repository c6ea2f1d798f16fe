"""``vllm serve`` for the live tests: ``python -m live.serve serve MODEL ...`` (``vllm_tests`` on
``PYTHONPATH``), vLLM's own command line after vLLM's CPU Triton check is passed (``no_triton``).

The check runs in every process ``vllm serve`` starts (its API servers and engine cores, each
spawned: each imports this module again, as ``__mp_main__``, before it checks its config), so
it is passed at import, as ``live.driver`` does for ``vllm.LLM``.
"""

from __future__ import annotations

import sys

import no_triton

no_triton.allow()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
