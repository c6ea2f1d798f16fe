"""Puts the suite's support modules (tests/support) on ``sys.path``: the programs
in this folder run as scripts in their own processes, outside pytest."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
