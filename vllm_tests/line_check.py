"""``make vllm-line-check VLLM=X``: a vLLM release's wheel read against the lines' table.

Reads the release's wheel (downloaded once into ``<cache>/wheels``, as lines.py does), never
importing it: ``KVCacheBlock``'s fields and how it names its pool, ``FreeKVCacheBlockQueue``'s
methods, the guarded ``BlockPool`` methods' parameters, the other ``BlockPool`` methods that
write a ``ref_cnt``, and the torch it pins. A release that is a row of the table already is
checked against its row. Any other is compared with the newest row (a release older than
every row: with the oldest), and with the source of that row's release (the guarded methods,
the block and the queue, docstrings and comments aside): when nothing but the version moved
it prints the row to add; else exactly what differs, which kvqueue's code must learn before
the row can be added.

Exit status: 0 when the release is a row already and its wheel agrees (the Makefile then runs
its suites three ways); 1 when the printed row is to be added; 2 when the code must learn
something first.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import lines

from kvqueue.vllm import _lines
from kvqueue.vllm._lines import LINES, Line, find, parse
from kvqueue.vllm._registry import GUARDED

_UTILS = "vllm/v1/core/kv_cache_utils.py"
_POOL = "vllm/v1/core/block_pool.py"


class Facts:
    """What one release's wheel says of what kvqueue depends on."""

    def __init__(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            utils = ast.parse(archive.read(_UTILS).decode())
            pool = ast.parse(archive.read(_POOL).decode())
            (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            meta = archive.read(metadata).decode()
        block = _class(utils, "KVCacheBlock")
        queue = _class(utils, "FreeKVCacheBlockQueue")
        pool_class = _class(pool, "BlockPool")
        annotated = [s for s in block.body if isinstance(s, ast.AnnAssign)]
        self.block_fields = tuple(
            s.target.id
            for s in annotated
            if isinstance(s.target, ast.Name) and "ClassVar" not in ast.unparse(s.annotation)
        )
        self.pool_annotation = next(
            (ast.unparse(s.annotation) for s in annotated if ast.unparse(s.target) == "pool"), None
        )
        self.queue_methods = frozenset(
            f.name
            for f in queue.body
            if isinstance(f, ast.FunctionDef)
            and not f.name.startswith("_")
            and not any(ast.unparse(d) == "property" for d in f.decorator_list)
        )
        methods = {f.name: f for f in pool_class.body if isinstance(f, ast.FunctionDef)}
        self.pool_methods = {
            name: tuple(a.arg for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs])[1:]
            for name, f in methods.items()
            if name in GUARDED
        }
        self.count_writers = frozenset(
            name for name, f in methods.items() if name not in GUARDED and _writes_ref_cnt(f)
        )
        pin = re.search(r"^Requires-Dist: torch==(\d+\.\d+)", meta, re.MULTILINE)
        self.torch = pin.group(1) if pin else "?"
        self.sources = {
            "KVCacheBlock": _source(block),
            "FreeKVCacheBlockQueue": _source(queue),
            **{f"BlockPool.{name}": _source(methods[name]) for name in self.pool_methods},
        }


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"line_check.py: the wheel defines no {name}")


def _writes_ref_cnt(function: ast.FunctionDef) -> bool:
    for node in ast.walk(function):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        if any(isinstance(t, ast.Attribute) and t.attr == "ref_cnt" for t in targets):
            return True
    return False


def _source(node: ast.AST) -> str:
    """``node``'s code without docstrings (and, as ast has it, without comments)."""
    for each in ast.walk(node):
        body = getattr(each, "body", None)
        if (
            isinstance(each, (ast.ClassDef, ast.FunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            each.body = body[1:] or [ast.Pass()]
    return ast.unparse(node)


def facts_of(release: str) -> Facts:
    return Facts(lines.wheel(release))


def differences(row: Line, new: Facts, old: Facts | None) -> list[str]:
    """What ``new`` has that ``row`` (and its release's ``old`` source, if given) has not."""
    said: list[str] = []
    if new.block_fields != row.block_fields:
        said.append(_fields(row.block_fields, new.block_fields))
    weak = new.pool_annotation is not None and "weakref" in new.pool_annotation
    if weak != row.weak_pool:
        said.append(
            f"KVCacheBlock.pool is {new.pool_annotation!r}: a weak reference is "
            f"{'new' if weak else 'gone'} (Line.weak_pool, the guard's pool_ref)"
        )
    if new.queue_methods != row.queue_methods:
        added = sorted(new.queue_methods - row.queue_methods)
        gone = sorted(row.queue_methods - new.queue_methods)
        said.append(f"FreeKVCacheBlockQueue: methods added {added}, gone {gone} (both twins)")
    for name in GUARDED:
        was, now = row.pool_methods.get(name), new.pool_methods.get(name)
        if was != now:
            said.append(
                f"BlockPool.{name}: parameters {was} in {row.name}, {now} now "
                "(the guard's wrapper and the row's pool methods)"
            )
    if old is not None:
        added = sorted(new.count_writers - old.count_writers)
        if added:
            said.append(
                f"BlockPool methods that write ref_cnt and are not guarded, new since "
                f"{row.release}: {added} (a method to guard?)"
            )
        for name, source in new.sources.items():
            before = old.sources.get(name)
            if before is not None and before != source:
                diff = difflib.unified_diff(
                    before.splitlines(), source.splitlines(), row.release, "new", lineterm="", n=1
                )
                said.append(f"{name} changed since {row.release}:\n    " + "\n    ".join(diff))
    return said


def _fields(was: tuple[str, ...], now: tuple[str, ...]) -> str:
    if len(was) == len(now):
        moved = [f"{a} -> {b}" for a, b in zip(was, now, strict=True) if a != b]
        return f"KVCacheBlock fields renamed or reordered: {', '.join(moved)}"
    return (
        f"KVCacheBlock fields added {[f for f in now if f not in was]}, "
        f"gone {[f for f in was if f not in now]}: {now}"
    )


def row_text(release: str, facts: Facts) -> str:
    """The ``_line(...)`` call for the table, by the names ``_lines`` gives its values."""
    names = vars(_lines)

    def name_of(value: Any) -> str:
        found = [k for k, v in names.items() if k.isupper() and k.startswith("_") and v == value]
        return found[-1] if found else repr(value)

    return (
        f'    _line("{release}", {name_of(facts.block_fields)}, {name_of(facts.queue_methods)}, '
        f'{name_of(facts.pool_methods)}, "{facts.torch}"),'
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="a vLLM release, e.g. 0.35.0")
    parser.add_argument(
        "--against", help="compare with this row's release instead of the newest (a replay)"
    )
    args = parser.parse_args()
    release: str = args.release
    if parse(release) is None or release.count(".") < 2:
        raise SystemExit(f"line_check.py: {release!r} is not a release such as 0.35.0")
    start = time.monotonic()
    new = facts_of(release)
    row = find(release)
    if row is not None and row.release == release and args.against is None:
        problems = differences(row, new, None)
        if new.torch != row.torch:
            problems.append(f"torch {new.torch} pinned, the row says {row.torch}")
        if problems:
            print(f"vLLM {release}'s wheel is not its row of src/kvqueue/vllm/_lines.py:")
            print("\n".join(f"  - {each}" for each in problems))
            return 2
        print(f"vLLM {release}: its wheel agrees with its row ({time.monotonic() - start:.0f} s)")
        return 0
    # A release older than every row is read against the oldest, which it would precede.
    older = parse(release) < LINES[0].minor  # type: ignore[operator]
    against = find(args.against) if args.against else LINES[0] if older else LINES[-1]
    if against is None:
        raise SystemExit(f"line_check.py: {args.against} is no row of the table")
    problems = differences(against, new, facts_of(against.release))
    seconds = time.monotonic() - start
    if problems:
        print(
            f"vLLM {release} differs from vLLM {against.release} (the row of {against.name}) "
            f"where kvqueue's code must learn it first ({seconds:.0f} s):"
        )
        print("\n".join(f"  - {each}" for each in problems))
        return 2
    where = (
        f"in place of the row of {row.name}"
        if row is not None
        else f"before the row of {LINES[0].name}"
        if older
        else f"after the row of {against.name}"
    )
    print(f"vLLM {release} is read as vLLM {against.release} is ({seconds:.0f} s). The row to add")
    print(f"to src/kvqueue/vllm/_lines.py, {where}:")
    print(row_text(release, new))
    newest = parse(release) > LINES[-1].minor  # type: ignore[operator]
    if newest or (row is not None and row is LINES[-1]):
        print(f"and in vllm_tests/vllm.env: VLLM_VERSION={release}")
    print(f"then: make vllm-line-check VLLM={release} (its suites three ways)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
