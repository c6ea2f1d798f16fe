"""The KV-cache block: one slotted class shared by both queue twins."""

from __future__ import annotations

from types import MemberDescriptorType
from typing import Any

__all__ = (
    "LAYOUT",
    "KVCacheBlock",
    "check_block_type",
    "is_block",
    "is_subtype",
    "layout_change",
    "lookup",
)

_LINKS = ("prev_free_block", "next_free_block")
# How the interpreter reads and writes an instance's attributes: the compiled twin
# bypasses these (it uses the slots' offsets), so a class may not change them.
_ACCESS = ("__getattribute__", "__setattr__", "__delattr__", "__getattr__")
# What a block's subclass must inherit untouched: the slots the compiled twin
# reads by offset, and the attribute access the pure twin goes through. Written
# only here: the compiled twin's C is handed this tuple (_slots.h).
LAYOUT = (*_LINKS, "pool", *_ACCESS)
MISSING: Any = object()
# type's own descriptors, not attribute access on the class: a metaclass cannot
# substitute a property for them, so these run no Python code.
_mro = type.__dict__["__mro__"].__get__
_namespace = type.__dict__["__dict__"].__get__


class KVCacheBlock:
    """KV-cache block metadata, field for field vLLM's ``KVCacheBlock``.

    A plain ``__slots__`` class rather than a compiled type: the 3.11+
    specializing interpreter reads and writes slot members several times faster
    than the getset descriptors of a Cython cdef class, and an engine touches
    these attributes from Python on every step.

    Equality and hashing are by identity. vLLM's dataclass compares field by
    field, which walks the free-list links; no engine relies on that.
    """

    __slots__ = (
        "__weakref__",
        "_block_hash",
        "_block_hash_num_tokens",
        "block_id",
        "is_null",
        "next_free_block",
        "pool",
        "prev_free_block",
        "ref_cnt",
    )
    __match_args__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "_block_hash_num_tokens",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    block_id: int
    ref_cnt: int
    pool: Any
    _block_hash: Any
    _block_hash_num_tokens: int | None
    prev_free_block: KVCacheBlock | None
    next_free_block: KVCacheBlock | None
    is_null: bool

    def __init__(
        self,
        block_id: int,
        ref_cnt: int = 0,
        _block_hash: Any = None,
        _block_hash_num_tokens: int | None = None,
        prev_free_block: KVCacheBlock | None = None,
        next_free_block: KVCacheBlock | None = None,
        is_null: bool = False,
        *,
        pool: Any = None,
    ) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.pool = pool
        self._block_hash = _block_hash
        self._block_hash_num_tokens = _block_hash_num_tokens
        self.prev_free_block = prev_free_block
        self.next_free_block = next_free_block
        self.is_null = is_null

    @property
    def block_hash(self) -> Any:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: Any, num_tokens: int | None = None) -> None:
        # An explicit raise, not ``assert``: the check must survive ``python -O``.
        if self._block_hash is not None or self._block_hash_num_tokens is not None:
            raise AssertionError("The block already has a hash. This should not happen.")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Reset the block hash when the block is evicted."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A copy, deep copy or pickle is detached: the links belong to the queue
        # the original is in, and a copy that kept them would corrupt it.
        return (
            _detached,
            (
                type(self),
                self.block_id,
                self.ref_cnt,
                self._block_hash,
                self._block_hash_num_tokens,
                self.is_null,
                self.pool,
            ),
        )

    def __repr__(self) -> str:
        # Neighbours by id only: a full repr would recurse along the list.
        prev_block = self.prev_free_block
        next_block = self.next_free_block
        prev_block_id = prev_block.block_id if prev_block else None
        next_block_id = next_block.block_id if next_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, "
            f"ref_cnt={self.ref_cnt}, "
            f"_block_hash={self._block_hash!r}, "
            f"_block_hash_num_tokens={self._block_hash_num_tokens}, "
            f"prev_free_block={prev_block_id}, "
            f"next_free_block={next_block_id})"
        )


def _detached(
    cls: type[KVCacheBlock],
    block_id: int,
    ref_cnt: int,
    block_hash: Any,
    block_hash_num_tokens: int | None,
    is_null: bool,
    pool: Any,
) -> KVCacheBlock:
    return cls(block_id, ref_cnt, block_hash, block_hash_num_tokens, None, None, is_null, pool=pool)


def check_block_type(block_type: object) -> type:
    """Return ``block_type`` if both twins can thread its instances.

    The compiled twin reads and writes the two links through their slot
    offsets, so both must be plain ``__slots__`` members; the pure twin
    enforces the same rule so that the twins accept the same classes.
    """
    if not isinstance(block_type, type):
        raise TypeError(f"block_type must be a class, not {type(block_type).__name__}")
    for name in _ACCESS:
        if lookup(block_type, name) is not lookup(object, name):
            raise TypeError(
                f"{block_type.__qualname__} overrides {name}: the queue reads and writes "
                "the links as plain slots, which both twins must see alike"
            )
    for name in _LINKS:
        descr = getattr(block_type, name, None)
        if type(descr) is not MemberDescriptorType:
            raise TypeError(
                f"{block_type.__qualname__}.{name} must be a __slots__ member "
                f"(e.g. a @dataclass(slots=True) field), not {type(descr).__name__}"
            )
        # A metaclass can lend another class's slot; its offset would point
        # past the end of this class's instances.
        if not is_subtype(block_type, descr.__objclass__):
            raise TypeError(
                f"{block_type.__qualname__}.{name} is a slot of "
                f"{descr.__objclass__.__qualname__}, not of a base of this class"
            )
    return block_type


def lookup(cls: type, name: str) -> Any:
    """What ``cls.name`` resolves to, as C's ``_PyType_Lookup`` finds it: by the MRO,
    running no descriptor, metaclass hook or other Python code. ``MISSING`` if none."""
    for base in _mro(cls):
        found = _namespace(base).get(name, MISSING)
        if found is not MISSING:
            return found
    return MISSING


def layout_change(obj_type: type, block_type: type) -> str | None:
    """The first of the links, ``pool`` and the attribute-access hooks that subclass
    ``obj_type`` redefines (a slot of its own, a property, ...), or None."""
    for name in LAYOUT:
        if lookup(obj_type, name) is not lookup(block_type, name):
            return name
    return None


def is_block(obj: object, block_type: type) -> bool:
    """Whether the queue of ``block_type`` threads ``obj``: an instance of that class,
    or of a subclass that keeps its layout (the compiled twin's ``kvq_is_block``)."""
    obj_type = type(obj)
    return obj_type is block_type or (
        is_subtype(obj_type, block_type) and layout_change(obj_type, block_type) is None
    )


def is_subtype(obj_type: type, block_type: type) -> bool:
    """``issubclass`` by the MRO alone, as C's ``PyType_IsSubtype`` decides.

    Unlike ``isinstance`` it consults no ``__class__`` attribute and no
    metaclass hook, so the pure twin accepts exactly the blocks the compiled
    twin does. Only subclass instances get here (exact types are checked by
    identity first).
    """
    return any(base is block_type for base in _mro(obj_type))
