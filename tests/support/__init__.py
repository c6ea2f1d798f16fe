"""The suite's helpers, imported as ``support.NAME`` by the tests and by the programs of
``tests/isolated`` alike (tests/ is first on the path of both: pyproject's pytest
``pythonpath``, and ``helpers.run_isolated``)."""
