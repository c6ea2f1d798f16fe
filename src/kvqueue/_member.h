/* The one slot lookup of kvqueue's compiled code: the queue (_slots.h) threads blocks
   through the offsets it gives, and the pool guard's screens (_screen.h) read blocks by
   them. Both modules include it; everything here is static to each. */

#ifndef KVQUEUE_MEMBER_H
#define KVQUEUE_MEMBER_H

#include "structmember.h"
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
#endif

/* The byte offset at which instances of `tp` keep attribute `name`, or -1: `name` must
   resolve, by the MRO as _PyType_Lookup finds it (no Python code runs, no exception is
   set), to an object-slot member descriptor of `tp` or of one of its bases, inside that
   class's instances. A metaclass can lend `tp` another class's descriptor, whose offset
   means nothing in `tp`'s instances (it may point past their end): refused.
   `writable`: a read-only member is refused too. */
static Py_ssize_t kv_member_offset(PyTypeObject *tp, PyObject *name, int writable)
{
    PyObject *d = _PyType_Lookup(tp, name);
    PyMemberDescrObject *md;
    PyMemberDef *m;
    if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
    md = (PyMemberDescrObject *)d;
    m = md->d_member;
    if (m->type != Py_T_OBJECT_EX || (writable && (m->flags & Py_READONLY))) return -1;
    if (!PyType_IsSubtype(tp, PyDescr_TYPE(md))) return -1;
    if (m->offset < (Py_ssize_t)sizeof(PyObject)
        || m->offset + (Py_ssize_t)sizeof(PyObject *) > PyDescr_TYPE(md)->tp_basicsize)
        return -1;
    return m->offset;
}

#endif /* KVQUEUE_MEMBER_H */
