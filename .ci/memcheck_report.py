"""Summarize AddressSanitizer and valgrind logs; exit 1 on any finding.

Usage: python memcheck_report.py LOG_DIR

Findings: any AddressSanitizer error, any valgrind memory error (invalid read,
write or free, mismatched free, overlap...), and any leak whose allocation
stack passes through kvqueue's code (LeakSanitizer's "Direct leak", valgrind's
"definitely lost"), not only through its module's imports of others. Other
leaks, the interpreter's own at exit, are counted but are not findings. Note
that a leaked *object* the cycle collector tracks stays reachable from its
lists, so neither tool sees it: those are tests/test_leaks.py's job.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

OURS = re.compile(r"kvqueue|_queue\.c|_queue\.pyx")
# kvqueue's module importing another as it is imported: what that import allocates is the
# interpreter's to free, and CPython 3.12 and 3.13 keep it at exit (valgrind calls it lost).
IMPORTING = re.compile(r"__Pyx__?Import|__pyx_pymod_exec_")
VALGRIND_ERROR = re.compile(
    r"Invalid (read|write|free)|Mismatched free|Source and destination overlap"
    r"|Use of uninitialised value|Conditional jump"
)
LEAK = re.compile(r"Direct leak of|[\d,]+ bytes in [\d,]+ blocks are definitely lost")


def _records(text: str, start: re.Pattern[str]) -> list[str]:
    """The report's records: each from a line matching ``start`` to a blank line."""
    records, current = [], None
    for line in text.splitlines():
        body = re.sub(r"^==\d+== ?", "", line)
        if start.match(body):
            current = [body]
            records.append(current)
        elif current is not None:
            if not body.strip():
                current = None
            else:
                current.append(body)
    return ["\n".join(r) for r in records]


def main() -> int:
    log_dir = Path(sys.argv[1])
    asan_errors = valgrind_errors = our_leaks = other_leaks = files = 0
    for path in sorted(log_dir.glob("*.log*")):
        files += 1
        text = path.read_text(errors="replace")
        asan = _records(text, re.compile(r"ERROR: AddressSanitizer"))
        errors = [r for r in _records(text, VALGRIND_ERROR) if _ours_or_memory(r)]
        leaks = _records(text, LEAK)
        mine = [r for r in leaks if _ours(r)]
        for record in (*asan, *errors, *mine):
            print(f"--- {path.name}\n{record}\n")
        asan_errors += len(asan)
        valgrind_errors += len(errors)
        our_leaks += len(mine)
        other_leaks += len(leaks) - len(mine)
    print(
        f"memcheck: {files} logs; AddressSanitizer errors: {asan_errors}; "
        f"valgrind memory errors: {valgrind_errors};\n"
        f"  definite leaks through kvqueue: {our_leaks}; "
        f"other definite leaks (the interpreter's): {other_leaks}"
    )
    return 1 if asan_errors or valgrind_errors or our_leaks else 0


def _ours(record: str) -> bool:
    """A frame of kvqueue's own code is on the allocation's stack, not only its imports."""
    return any(OURS.search(line) and not IMPORTING.search(line) for line in record.splitlines())


def _ours_or_memory(record: str) -> bool:
    """Invalid accesses count wherever they are; uninitialised-value reports
    only through kvqueue (CPython's own, e.g. hashing urandom bytes, are not ours)."""
    first = record.splitlines()[0]
    return not first.startswith(("Use of uninitialised", "Conditional jump")) or bool(
        OURS.search(record)
    )


if __name__ == "__main__":
    sys.exit(main())
