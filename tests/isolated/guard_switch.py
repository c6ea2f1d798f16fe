"""A pool guard switched between the twins' screens while another thread frees through it.

One thread loops ``(a,) = pool.get_new_blocks(1); pool.free_blocks([a, a])`` under
``repair``; this one replaces the guard ``SWITCHES`` times, alternating the compiled and
the pure screens, as ``install()`` alternating ``"python"`` and ``"cython"`` does; the
interpreter switches threads every microsecond. Each replaced guard dies in the middle of
the other thread's calls: the process must not crash, and every repair must be counted.

Usage: python -m isolated.guard_switch SWITCHES
"""

from __future__ import annotations

import json
import logging
import sys
import threading

from kvqueue.vllm import _pool_guard

from support.fake_pool import line, make_pool, policy_of, pool_class, screen_of, state
from support.twins import twin


def main() -> None:
    switches = int(sys.argv[1])
    logger = logging.getLogger("kvqueue")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    of = line("0.33")
    cls = pool_class(of)
    screens = [screen_of(twin("cython")), screen_of(twin("python"))]
    _pool_guard.guard(cls, screens[0], policy_of, wrap_foreign=False, line=of)
    pool = make_pool(cls, twin("cython"), 8, "repair")
    done = threading.Event()
    freed = [0]

    def free_twice() -> None:
        while not done.is_set():
            (block,) = pool.get_new_blocks(1)
            pool.free_blocks([block, block])
            freed[0] += 1

    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=free_twice)
    worker.start()
    try:
        for i in range(switches):
            _pool_guard.guard(cls, screens[i % 2], policy_of, wrap_foreign=False, line=of)
    finally:
        done.set()
        worker.join()
    repairs = _pool_guard.pool_repairs(pool)["double_free"]
    assert repairs == freed[0], (repairs, freed[0])
    assert state(pool)[2] == 7
    print(json.dumps({"switches": switches, "frees": freed[0]}))


if __name__ == "__main__":
    main()
