/* The C behind the pool guard's compiled screens (_screen.pyx): a block's fields read
   straight from its slots when its class lays them out as plain __slots__ members, as
   vLLM's @dataclass(slots=True) KVCacheBlock does. No Python code runs on such a read.
   Everything here is static to that one module. */

#ifndef KVQUEUE_SCREEN_H
#define KVQUEUE_SCREEN_H

#include "../_member.h"

/* The byte offset of instances of `tp` at which attribute `name` is stored, when an
   instance's read of `name` is exactly that slot's: `tp` is a plain class (metaclass
   `type`, generic attribute access, so no __getattr__ / __getattribute__) and `name`
   resolves to an object-slot member of `tp` or a base (kv_member_offset). Else -1. */
static Py_ssize_t kvs_slot(PyTypeObject *tp, PyObject *name)
{
    if (Py_TYPE(tp) != &PyType_Type || tp->tp_getattro != PyObject_GenericGetAttr)
        return -1;
    return kv_member_offset(tp, name, 0);
}

/* `tp`'s version tag, or 0 when it has no valid one. CPython changes it whenever `tp` or
   a base is modified, and never hands a freed class's tag to another. */
static inline unsigned int kvs_version(PyTypeObject *tp)
{
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
#endif
    return tp->tp_version_tag;
}

/* The slot's value, borrowed; NULL when it was never set or was deleted. */
#define KVS_SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* Ask for a block's first two cache lines (its header and slots) ahead of its reads: a
   batch's blocks lie scattered in memory, and a screen that reads one block after another
   would wait for each in turn. A hint only: no fault, no effect on what is read. */
#if defined(__GNUC__) || defined(__clang__)
#define KVS_PREFETCH(o) (__builtin_prefetch((char *)(o)), __builtin_prefetch((char *)(o) + 64))
#define KVS_HINT(p) __builtin_prefetch(p)
#else
#define KVS_PREFETCH(o) ((void)(o))
#define KVS_HINT(p) ((void)(p))
#endif

/* Whether `ref` is a weak reference (weakref.ref exactly) to `obj`, read without a call
   (a door's check of its pool at every allocation and prefix hit); never raises. */
static inline int kvs_refers_to(PyObject *ref, PyObject *obj)
{
    if (!PyWeakref_CheckRefExact(ref))
        return 0;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *got = NULL;
    if (PyWeakref_GetRef(ref, &got) < 0) {
        PyErr_Clear();
        return 0;
    }
    int same = got == obj;
    Py_XDECREF(got);
    return same;
#else
    return PyWeakref_GET_OBJECT(ref) == obj;
#endif
}

/* A ref_cnt as the screens compare it: 1 and its value in *out (clamped to Py_ssize_t)
   for an int or an int subclass, read as int (no __index__ or other code of its own
   runs); 0 for anything else, which the guard refuses. Inline for a small exact int, the
   count of every block of vLLM's: this runs once per block of every guarded call. */
static inline int kvs_count(PyObject *v, Py_ssize_t *out)
{
    int overflow;
    long long x;
    if (PyLong_CheckExact(v)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
            *out = PyUnstable_Long_CompactValue((PyLongObject *)v);
            return 1;
        }
#else
        Py_ssize_t size = Py_SIZE(v);
        if (size >= -1 && size <= 1) {
            *out = size * (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
            return 1;
        }
#endif
    }
    else if (!PyLong_Check(v))
        return 0;
    x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow > 0 || x > PY_SSIZE_T_MAX) x = PY_SSIZE_T_MAX;
    else if (overflow < 0 || x < PY_SSIZE_T_MIN) x = PY_SSIZE_T_MIN;
    *out = (Py_ssize_t)x;
    return 1;
}

/* How far ahead of a pass's reads its hints run, in blocks: a block's memory 3 * KVS_AHEAD
   on, its block_id's int 2 * KVS_AHEAD on, the index's entries KVS_AHEAD on. Each stage reads
   only what the one before asked for, so that no hint itself waits on memory. */
#define KVS_AHEAD 4

/* Ask for the memory of the blocks of `blocks` (a list) that a pass at place `i` reads
   3 * KVS_AHEAD places on; at place 0, for the blocks before that too. */
static inline void kvs_hint_blocks(PyObject *blocks, Py_ssize_t i)
{
    Py_ssize_t n = PyList_GET_SIZE(blocks), far = i + 3 * KVS_AHEAD, k;
    if (i == 0)
        for (k = 0; k < far && k < n; k++) KVS_PREFETCH(PyList_GET_ITEM(blocks, k));
    if (far < n) KVS_PREFETCH(PyList_GET_ITEM(blocks, far));
}

/* The block_id of the block `ahead` places on in `blocks`, from its class's slot at `off`
   (the class `tp`'s), or NULL; borrowed, only a slot read: no code runs. `tp` NULL: no
   class learned yet (`off` is then not read). */
static inline PyObject *kvs_id_ahead(PyObject *blocks, Py_ssize_t ahead, PyTypeObject *tp,
                                     Py_ssize_t off)
{
    PyObject *block;
    if (tp == NULL || off < 0 || ahead >= PyList_GET_SIZE(blocks)) return NULL;
    block = PyList_GET_ITEM(blocks, ahead);
    if (Py_TYPE(block) != tp) return NULL;
    return KVS_SLOT(block, off);
}

/* At place `i` of a pass over `blocks`, ask for the int of the block_id 2 * KVS_AHEAD places
   on, and for the holder index's entries of the block KVS_AHEAD places on: its count in
   `counts` and its block in `pool_blocks`, both lists as long as the pool, read at random
   places. Anything unusual asks for nothing. */
static inline void kvs_hint_entries(PyObject *blocks, Py_ssize_t i, PyTypeObject *tp,
                                    Py_ssize_t off, PyObject *counts, PyObject *pool_blocks)
{
    PyObject *value = kvs_id_ahead(blocks, i + 2 * KVS_AHEAD, tp, off);
    Py_ssize_t id;
    if (value != NULL) KVS_HINT(value);
    value = kvs_id_ahead(blocks, i + KVS_AHEAD, tp, off);
    if (value == NULL || !PyLong_CheckExact(value) || !kvs_count(value, &id) || id < 0) return;
    if (id < PyList_GET_SIZE(counts)) KVS_HINT(((PyListObject *)counts)->ob_item + id);
    if (id < PyList_GET_SIZE(pool_blocks)) KVS_HINT(((PyListObject *)pool_blocks)->ob_item + id);
}

#endif
