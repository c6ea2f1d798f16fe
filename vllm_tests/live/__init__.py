"""A live vLLM engine (the release vllm.env pins) on the CPU with a stub model, for kvqueue's
engine-level tests.

``model`` writes a config-only model directory, ``executor`` is the stub model executor vLLM
runs in its engine-core process, ``scheduler`` is vLLM's own scheduler with a check of the
block pool after every step and the double-free injector, ``driver`` starts the engine as a
user does (one engine per process, its result as JSON). ``examples/demo.py``,
``bench/throughput.py`` and ``vllm_tests/test_live_engine.py`` run the driver, ``vllm_tests`` on
their ``PYTHONPATH``.
"""

#: The engine core's journal file (JSON lines), written by ``live.scheduler``.
JOURNAL = "_KVQUEUE_TEST_JOURNAL"
#: ``A``, ``B``, ``C``, ``D`` or several (``AB``): the faults ``live.scheduler`` injects.
INJECT = "_KVQUEUE_TEST_INJECT"
#: How many of each form (default 1).
INJECT_COUNT = "_KVQUEUE_TEST_INJECT_COUNT"
