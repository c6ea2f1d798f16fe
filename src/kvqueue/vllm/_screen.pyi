# The compiled twin's types are the pure twin's: one source of truth.
from ._screen_py import HOLDER_FAULTS as HOLDER_FAULTS
from ._screen_py import OTHER_POOLS as OTHER_POOLS
from ._screen_py import REPEATS as REPEATS
from ._screen_py import Door as Door
from ._screen_py import Listed as Listed
from ._screen_py import Table as Table
from ._screen_py import alloc_guard as alloc_guard
from ._screen_py import first_excess as first_excess
from ._screen_py import first_held_free as first_held_free
from ._screen_py import first_listed as first_listed
from ._screen_py import first_listed_free as first_listed_free
from ._screen_py import first_negative as first_negative
from ._screen_py import first_under_listed as first_under_listed
from ._screen_py import free_guard as free_guard
from ._screen_py import holder_faults as holder_faults
from ._screen_py import passes_free as passes_free
from ._screen_py import passes_hand_out as passes_hand_out
from ._screen_py import passes_touch as passes_touch
from ._screen_py import quiet_step as quiet_step
from ._screen_py import step_guard as step_guard
from ._screen_py import touch_guard as touch_guard

__all__ = (
    "HOLDER_FAULTS",
    "OTHER_POOLS",
    "REPEATS",
    "Door",
    "Listed",
    "Table",
    "alloc_guard",
    "first_excess",
    "first_held_free",
    "first_listed",
    "first_listed_free",
    "first_negative",
    "first_under_listed",
    "free_guard",
    "holder_faults",
    "passes_free",
    "passes_hand_out",
    "passes_touch",
    "quiet_step",
    "step_guard",
    "touch_guard",
)
