"""A live vLLM 0.33.0 engine on the CPU with a stub model, for kvqueue's engine-level tests.

``model`` writes a config-only model directory, ``executor`` is the stub model executor vLLM
runs in its engine-core process, ``scheduler`` is vLLM's own scheduler with a check of the
block pool after every step and the double-free injector, ``driver`` starts the engine as a
user does (one engine per process, its result as JSON). ``demo``, ``throughput`` and the tests
in ``vllm_tests/test_live_engine.py`` run the driver.
"""
