""".ci/memcheck_report.py: which leaks are kvqueue's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.helpers import load_script

IMPORTED = """\
==1== 32 bytes in 1 blocks are definitely lost in loss record 1 of 9
==1==    at 0x4848899: malloc (vg_replace_malloc.c:381)
==1==    by 0x49E1D2A: PyUnicode_New (unicodeobject.c:1251)
==1==    by 0x6A6DCCC: __Pyx__Import.constprop.0 (_queue.c:18032)
==1==    by 0x6A6E8B2: __pyx_pymod_exec__queue (_queue.c:14236)

"""
OWN = IMPORTED.replace("__Pyx__Import.constprop.0", "__pyx_f_7kvqueue_6_queue_append")


def test_a_leak_through_kvqueues_code_is_a_finding_one_through_its_imports_is_not(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    report = load_script(".ci/memcheck_report.py")
    (tmp_path / "valgrind.1.log").write_text(IMPORTED)
    monkeypatch.setattr("sys.argv", ["memcheck_report.py", str(tmp_path)])
    assert report.main() == 0
    assert "definite leaks through kvqueue: 0; other definite leaks" in capsys.readouterr().out
    (tmp_path / "valgrind.2.log").write_text(OWN)
    assert report.main() == 1
    out = capsys.readouterr().out
    assert "__pyx_f_7kvqueue_6_queue_append" in out
    assert all(len(line) <= 100 for line in out.splitlines()[-2:])
