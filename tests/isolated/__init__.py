"""Programs that may crash or hang, each run in a fresh interpreter by
``support.helpers.run_isolated`` (``python -m isolated.NAME ARGS``)."""
