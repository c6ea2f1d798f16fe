/* The C behind the pool guard's compiled screens (_screen.pyx): a block's fields read
   straight from its slots when its class lays them out as plain __slots__ members, as
   vLLM's @dataclass(slots=True) KVCacheBlock does. No Python code runs on such a read.
   Everything here is static to that one module. */

#ifndef KVQUEUE_SCREEN_H
#define KVQUEUE_SCREEN_H

#include "structmember.h"
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif

/* The byte offset of instances of `tp` at which attribute `name` is stored, when an
   instance's read of `name` is exactly that slot's: `tp` is a plain class (metaclass
   `type`, generic attribute access, so no __getattr__ / __getattribute__) and `name`
   resolves to an object-slot member descriptor inside the instance. Else -1. */
static Py_ssize_t kvs_slot(PyTypeObject *tp, PyObject *name)
{
    PyObject *d;
    Py_ssize_t off = -1;
    if (Py_TYPE(tp) != &PyType_Type || tp->tp_getattro != PyObject_GenericGetAttr)
        return -1;
    d = PyObject_GetAttr((PyObject *)tp, name);
    if (d == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (Py_TYPE(d) == &PyMemberDescr_Type) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == Py_T_OBJECT_EX && m->offset >= (Py_ssize_t)sizeof(PyObject)
            && m->offset + (Py_ssize_t)sizeof(PyObject *) <= tp->tp_basicsize)
            off = m->offset;
    }
    Py_DECREF(d);
    return off;
}

/* The slot's value, borrowed; NULL when it was never set or was deleted. */
#define KVS_SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

#endif
