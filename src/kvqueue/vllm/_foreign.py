"""What another project patched in vLLM, found in one place: vLLM's queue class replaced or
changed, or a ``BlockPool`` method the guard wraps replaced (``_errors.foreign_patch`` is
kvqueue's refusal of it).

A guarded pool method is vLLM's own when it was defined in the module of the class that
holds it, with that class's qualified name: its globals are that module's
(``functools.wraps`` copies a name, never the globals). The queue class and its methods are
read by the module they name.
"""

from __future__ import annotations

import sys
from types import FunctionType

__all__ = ("METHOD_WRAPPED", "QUEUE_WRAPPED", "method_patch", "queue_patch")

# What install(wrap_foreign=True) then does, by what was patched.
QUEUE_WRAPPED = "replaces it with kvqueue's queue anyway"
METHOD_WRAPPED = "has kvqueue's guard wrap it"


def queue_patch(original: type, pool_name: object, utils: str, pool: str, name: str) -> str | None:
    """What another project changed in vLLM's queue class ``original``, which module
    ``utils`` binds to ``name`` (``pool_name``: what module ``pool`` binds to it), if
    anything."""
    if pool_name is not original:
        return _replaced(f"{pool}.{name} is not {utils}.{name}", pool_name)
    if original.__module__ != utils:
        return _replaced(f"{utils}.{name} is not vLLM's own", original)
    for attribute, value in vars(original).items():
        if callable(value) and getattr(value, "__module__", utils) != utils:
            return _replaced(f"{utils}.{name}.{attribute} is not vLLM's own", value)
    return None


def method_patch(pool_class: type, name: str, found: object) -> str | None:
    """What replaced ``pool_class``'s method ``name`` with ``found``, unless it is vLLM's own."""
    module = sys.modules.get(pool_class.__module__)
    own = f"{pool_class.__qualname__}.{name}"
    if (
        type(found) is FunctionType
        and module is not None
        and found.__globals__ is vars(module)
        and found.__qualname__ == own
    ):
        return None
    return _replaced(f"{pool_class.__module__}.{own} is not vLLM's own", found)


def _replaced(what: str, found: object) -> str:
    module = getattr(found, "__module__", None) or "an unknown module"
    name = getattr(found, "__qualname__", None) or type(found).__qualname__
    code = getattr(found, "__code__", None) if type(found) is FunctionType else None
    if code is None:
        return f"{what}: {module}.{name} replaced it"
    path = code.co_filename.replace("\\", "/")
    site = "/".join((path.rpartition("-packages/")[2] or path).split("/")[-4:])
    site = f"{site}:{code.co_firstlineno}"
    if hasattr(found, "__wrapped__"):
        # A functools.wraps wrapper copied its name from what it wraps: named by its code.
        return f"{what}: a wrapper defined at {site} (named {module}.{name}) replaced it"
    return f"{what}: {module}.{name}, defined at {site}, replaced it"
