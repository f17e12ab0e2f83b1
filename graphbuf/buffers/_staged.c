/* Staged writes and their commit in C (buffer protocol, no numpy C API): part of the one native backend,
 * graphbuf.buffers._native (this file and _native.c are one extension; gb_staged_init adds these to it).
 *
 * Staged(host, lens, pad, lo, hi, table, index, lock, colmax, top, checks, ndarray)
 *     One staged buffer's host state (graphbuf.buffers.staged): host, the whole allocation (1-D or 2-D,
 *     C-contiguous, writable); lens, int64 per row (2-D; None for 1-D); pad, the pad's bytes; lo/hi, the
 *     value bounds (None: unbounded); table, rows at n live requests (None: rows do not follow requests);
 *     index, the slot index the high-water marks are kept by; lock, the buffers' guard (a threading.Lock);
 *     colmax/top, the column and row marks of the host state; checks, the Python checks of the buffer
 *     (staged._Checks); ndarray, numpy's array type. The changed cells are kept here.
 *
 *     Methods set, append, set_row, clear_row, move_row, swap_rows, scatter: the write API of
 *     graphbuf.buffers.staged.StagedBuffer. Arguments in their plain form (int rows and columns in range,
 *     values as a 1-D contiguous numpy array (exactly ndarray) of the host's element type, or a list of
 *     ints that fit it) are applied here; anything else goes through checks._normalize(op, *args), which
 *     raises the Python path's error or returns the arguments in plain form, owned by it. A guard held
 *     elsewhere calls checks._busy(op). Scatter copies its plain indices and values before it checks them:
 *     what it writes is what it checked, even when they view the host state.
 *
 * commit(cores, n, rows_of, cols_of, targets, write) -> True | False | None | moved bytes
 *     A refresh's staged commit of n live requests, in place, in two calls, as the Python commit: write
 *     False before the refresh writes anything checks the cells a commit reads (changed cells of live rows,
 *     rows entering the live range) against lo..hi (and NaN): True when all pass, False when a value fails
 *     (the Python commit then names it), None when it cannot say (no table, a bound or kind it does not
 *     check; the Python commit then runs). write True, after the refresh wrote its full sources, writes
 *     those cells from each host state into its target (the buffer's flat view, one per core) and the rows
 *     leaving the live range to the pad, updates the marks in rows_of/cols_of (by slot index), forgets the
 *     changes and returns the bytes written. Staged buffers are never full sources of the same refresh, so
 *     writing them last cannot change a source before its own write.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kinds.h"

/* Bounds: 0 none; 1 the value; 2 beyond int64 above; -2 beyond int64 below. */
typedef struct {
    int lk, hk;
    int64_t lo, hi;
    double flo, fhi;
    int known; /* 0: a bound this code does not read (the caller's path checks) */
} Bounds;

static int bound_of(PyObject *o, int64_t *v, double *f, int *known) {
    if (o == Py_None) return 0;
    if (PyFloat_Check(o)) {
        *f = PyFloat_AS_DOUBLE(o);
        *known = 0; /* a float bound: only float buffers use it (below) */
        return 3;
    }
    if (!PyLong_Check(o)) {
        *known = 0;
        return 0;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    *f = PyLong_AsDouble(o);
    if (*f == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        *known = -1; /* beyond a double: no float buffer reads it here */
    }
    if (overflow > 0) return 2;
    if (overflow < 0) return -2;
    *v = (int64_t)x;
    return 1;
}

typedef struct {
    PyObject_HEAD
    Py_buffer host;
    Py_buffer lensb;
    int held, lheld;
    int kind;
    Py_ssize_t isz, rows, width;
    int wide;
    char pad[8];
    Bounds b;
    int64_t *table;
    Py_ssize_t ntable; /* -1: no table */
    Py_ssize_t index;
    PyObject *lock, *checks;
    PyObject *acquire, *release; /* lock.acquire and lock.release, bound once */
    PyTypeObject *ndarray;
    int64_t colmax, top;
    int64_t *runs; /* [start, stop) pairs of flat indices */
    Py_ssize_t nruns, caprun;
    int64_t *cells;
    Py_ssize_t ncells, capcell;
} Staged;

static PyObject *s_acquire, *s_release, *s_normalize, *s_busy, *s_name, *s_host_view, *s_lengths_view;

static inline char *at(const Staged *s, int64_t i) { return (char *)s->host.buf + i * s->isz; }
static inline int64_t *lens(const Staged *s) { return (int64_t *)s->lensb.buf; }

static int push_run(Staged *s, int64_t a, int64_t b) {
    if (s->nruns == s->caprun) {
        Py_ssize_t cap = s->caprun ? 2 * s->caprun : 16;
        int64_t *p = PyMem_Realloc(s->runs, (size_t)cap * 2 * sizeof(int64_t));
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        s->runs = p, s->caprun = cap;
    }
    s->runs[2 * s->nruns] = a, s->runs[2 * s->nruns + 1] = b;
    s->nruns++;
    return 0;
}

static int reserve_cells(Staged *s, Py_ssize_t k) {
    if (s->ncells + k <= s->capcell) return 0;
    Py_ssize_t cap = s->capcell ? s->capcell : 64;
    while (cap < s->ncells + k) cap *= 2;
    int64_t *p = PyMem_Realloc(s->cells, (size_t)cap * sizeof(int64_t));
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    s->cells = p, s->capcell = cap;
    return 0;
}

static void fill_pad(Staged *s, int64_t i, int64_t count) {
    char *d = at(s, i);
    for (int64_t j = 0; j < count; j++) memcpy(d + j * s->isz, s->pad, (size_t)s->isz);
}

/* ------------------------------------------------------------------------------------- arguments */

/* An int in [0, limit): 1 and *out; 0 when it is not (not an exact int, or out of range). */
static int plain_index(PyObject *o, Py_ssize_t limit, Py_ssize_t *out) {
    if (!PyLong_CheckExact(o)) return 0;
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (v < 0 || v >= limit) return 0;
    *out = v;
    return 1;
}

/* Values in plain form: a 1-D contiguous buffer of the host's element type, or a list of ints that fit. */
typedef struct {
    Py_buffer view;
    int held;
    const char *data;
    Py_ssize_t k;
    char *tmp;
    char small[512];
} Vals;

static void vals_release(Vals *v) {
    if (v->held) PyBuffer_Release(&v->view);
    if (v->tmp && v->tmp != v->small) PyMem_Free(v->tmp);
    v->held = 0, v->tmp = NULL;
}

static int int_fits(int kind, Py_ssize_t isz, PyObject *o, char *dst) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow) return 0;
    if (kind == K_SIGNED) {
        switch (isz) {
        case 1: if (x < INT8_MIN || x > INT8_MAX) return 0; { int8_t y = (int8_t)x; memcpy(dst, &y, 1); } return 1;
        case 2: if (x < INT16_MIN || x > INT16_MAX) return 0; { int16_t y = (int16_t)x; memcpy(dst, &y, 2); } return 1;
        case 4: if (x < INT32_MIN || x > INT32_MAX) return 0; { int32_t y = (int32_t)x; memcpy(dst, &y, 4); } return 1;
        case 8: { int64_t y = (int64_t)x; memcpy(dst, &y, 8); } return 1;
        default: return 0;
        }
    }
    if (x < 0) return 0;
    switch (isz) {
    case 1: if (x > UINT8_MAX) return 0; { uint8_t y = (uint8_t)x; memcpy(dst, &y, 1); } return 1;
    case 2: if (x > UINT16_MAX) return 0; { uint16_t y = (uint16_t)x; memcpy(dst, &y, 2); } return 1;
    case 4: if (x > UINT32_MAX) return 0; { uint32_t y = (uint32_t)x; memcpy(dst, &y, 4); } return 1;
    case 8: { uint64_t y = (uint64_t)x; memcpy(dst, &y, 8); } return 1;
    default: return 0;
    }
}

/* A 1-D contiguous numpy array (exactly ndarray: no subclass, no other buffer) of kind and item size: 1 and
 * v filled, else 0 (nothing held). */
static int plain_array(PyObject *o, PyTypeObject *ndarray, int kind, Py_ssize_t isz, Vals *v) {
    if (Py_TYPE(o) != ndarray) return 0;
    if (PyObject_GetBuffer(o, &v->view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return 0;
    }
    v->held = 1;
    Py_buffer *b = &v->view;
    if (!(b->ndim == 1 && b->itemsize == isz && kind_of(b) == kind &&
          (b->shape[0] <= 1 || !b->strides || b->strides[0] == isz))) {
        vals_release(v);
        return 0;
    }
    v->data = b->buf, v->k = b->shape[0];
    return 1;
}

/* 1: plain (v filled); 0: not plain; -1: error (memory). */
static int plain_values(const Staged *s, PyObject *o, Vals *v) {
    v->held = 0, v->tmp = NULL, v->k = 0, v->data = NULL;
    if (PyList_CheckExact(o)) {
        Py_ssize_t k = PyList_GET_SIZE(o);
        if (k && s->kind != K_SIGNED && s->kind != K_UNSIGNED) return 0;
        size_t need = (size_t)k * (size_t)s->isz;
        v->tmp = need <= sizeof v->small ? v->small : PyMem_Malloc(need ? need : 1);
        if (!v->tmp) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            if (!int_fits(s->kind, s->isz, PyList_GET_ITEM(o, i), v->tmp + i * s->isz)) {
                vals_release(v);
                return 0;
            }
        }
        v->data = v->tmp, v->k = k;
        return 1;
    }
    return plain_array(o, s->ndarray, s->kind, s->isz, v);
}

/* An int64 index array in plain form (scatter's rows and cols). */
static int plain_int64(const Staged *s, PyObject *o, Vals *v) {
    v->held = 0, v->tmp = NULL;
    return plain_array(o, s->ndarray, K_SIGNED, 8, v);
}

/* Arguments by position or keyword into out[0..n), defaults kept; -1 with the TypeError a Python method
 * StagedBuffer.<fn>(self, ...) of these names and ``required`` leading required ones would raise. */
static int parse(const char *fn, const char *const *names, int n, int required, PyObject *const *args,
                 Py_ssize_t nargs, PyObject *kwnames, PyObject **out) {
    if (nargs > n) {
        if (required == n)
            PyErr_Format(PyExc_TypeError, "StagedBuffer.%s() takes %d positional arguments but %zd were given", fn,
                         n + 1, nargs + 1);
        else
            PyErr_Format(PyExc_TypeError,
                         "StagedBuffer.%s() takes from %d to %d positional arguments but %zd were given", fn,
                         required + 1, n + 1, nargs + 1);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, j));
        if (!key) return -1;
        int found = -1;
        for (int i = 0; i < n; i++)
            if (strcmp(key, names[i]) == 0) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "StagedBuffer.%s() got an unexpected keyword argument '%s'", fn, key);
            return -1;
        }
        if (found < nargs) {
            PyErr_Format(PyExc_TypeError, "StagedBuffer.%s() got multiple values for argument '%s'", fn, key);
            return -1;
        }
        out[found] = args[nargs + j];
    }
    int missing = 0, first = -1, second = -1;
    for (int i = 0; i < required; i++)
        if (!out[i]) {
            if (first < 0) first = i;
            else second = i;
            missing++;
        }
    if (missing == 1) {
        PyErr_Format(PyExc_TypeError, "StagedBuffer.%s() missing 1 required positional argument: '%s'", fn,
                     names[first]);
        return -1;
    }
    if (missing == 2) { /* no op has more than two required arguments */
        PyErr_Format(PyExc_TypeError, "StagedBuffer.%s() missing 2 required positional arguments: '%s' and '%s'",
                     fn, names[first], names[second]);
        return -1;
    }
    return 0;
}

/* The guard, taken without waiting; a caller holding it elsewhere: _busy(op) raises its error. */
static int take(Staged *s, const char *op) {
    PyObject *r = PyObject_CallOneArg(s->acquire, Py_False);
    if (!r) return -1;
    int ok = r == Py_True;
    Py_DECREF(r);
    if (ok) return 0;
    PyObject *name = PyUnicode_FromString(op);
    if (!name) return -1;
    r = PyObject_CallMethodOneArg(s->checks, s_busy, name);
    Py_DECREF(name);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s(): the guard is held elsewhere", op);
    return -1;
}

static void give(Staged *s) {
    PyObject *tp, *val, *tb;
    PyErr_Fetch(&tp, &val, &tb);
    PyObject *r = PyObject_CallNoArgs(s->release);
    if (!r) PyErr_Clear();
    Py_XDECREF(r);
    PyErr_Restore(tp, val, tb);
}

/* checks._normalize(op, *args): a new tuple of the arguments in plain form, or NULL with its error. */
static PyObject *normalize(Staged *s, const char *op, PyObject *const *args, int n) {
    PyObject *stack[6];
    stack[0] = s->checks;
    stack[1] = PyUnicode_FromString(op);
    if (!stack[1]) return NULL;
    for (int i = 0; i < n; i++) stack[2 + i] = args[i];
    PyObject *r = PyObject_VectorcallMethod(s_normalize, stack, (size_t)(2 + n), NULL);
    Py_DECREF(stack[1]);
    if (r && (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != n)) {
        Py_DECREF(r);
        PyErr_Format(PyExc_SystemError, "%s(): _normalize returned a malformed result", op);
        return NULL;
    }
    return r;
}

static PyObject *unplain(const char *op) {
    PyErr_Format(PyExc_SystemError, "%s(): _normalize returned arguments that are not in plain form", op);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ writes */

static int do_set(Staged *s, Py_ssize_t r, const Vals *v, Py_ssize_t c) {
    Py_ssize_t k = v->k;
    if (s->wide) {
        int64_t start = (int64_t)r * s->width + c;
        if (k) memmove(at(s, start), v->data, (size_t)(k * s->isz));
        int64_t *ln = lens(s);
        if (c + k > ln[r]) {
            ln[r] = c + k;
            if (c + k > s->colmax) s->colmax = c + k;
        }
        if (push_run(s, start, start + k) < 0) return -1;
        if (r >= s->top) s->top = r + 1;
    } else {
        if (k) memmove(at(s, r), v->data, (size_t)(k * s->isz));
        if (push_run(s, r, r + k) < 0) return -1;
        if (r + k > s->top) s->top = r + k;
    }
    return 0;
}

/* set(row, values, col=0), and append(row, values) when append is 1. */
static PyObject *set_impl(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int append) {
    static const char *const names[] = {"row", "values", "col"};
    const char *op = append ? "append" : "set";
    PyObject *a[3] = {NULL, NULL, NULL};
    if (parse(op, names, append ? 2 : 3, 2, args, nargs, kwnames, a) < 0) return NULL;
    PyObject *zero = NULL;
    if (!a[2]) {
        zero = PyLong_FromLong(0);
        if (!zero) return NULL;
        a[2] = zero;
    }
    if (take(s, op) < 0) {
        Py_XDECREF(zero);
        return NULL;
    }
    PyObject *norm = NULL, *result = NULL;
    Vals v = {0};
    for (int attempt = 0;; attempt++) {
        Py_ssize_t r, c = 0;
        int rp = plain_index(a[0], s->rows, &r);
        int pv = rp ? plain_values(s, a[1], &v) : 0;
        if (pv < 0) goto done;
        int ok = rp && pv;
        if (ok && append) {
            ok = s->wide;
            c = ok ? (Py_ssize_t)lens(s)[r] : 0;
            if (ok && (c < 0 || c > s->width)) { /* lens is private (exposed read-only): never here */
                PyErr_Format(PyExc_SystemError, "append(): row %zd's length %zd is corrupt", r, c);
                goto done;
            }
            if (ok && c + v.k > s->width) { /* past the row's end: set()'s error, as the Python path */
                vals_release(&v);
                PyObject *col = PyLong_FromSsize_t(c);
                if (!col) goto done;
                PyObject *sa[3] = {a[0], a[1], col};
                PyObject *tmp = normalize(s, "set", sa, 3);
                Py_DECREF(col);
                Py_XDECREF(tmp);
                if (!PyErr_Occurred()) unplain(op);
                goto done;
            }
        } else if (ok && s->wide) {
            ok = plain_index(a[2], s->width + 1, &c) && c + v.k <= s->width;
        } else if (ok) {
            ok = PyLong_CheckExact(a[2]) && PyLong_AsLong(a[2]) == 0 && r + v.k <= s->rows;
            if (PyErr_Occurred()) PyErr_Clear();
        }
        if (ok) {
            if (do_set(s, r, &v, c) == 0) result = Py_NewRef(Py_None);
            goto done;
        }
        vals_release(&v);
        if (attempt) {
            unplain(op);
            goto done;
        }
        Py_XSETREF(norm, normalize(s, op, a, append ? 2 : 3));
        if (!norm) goto done;
        a[0] = PyTuple_GET_ITEM(norm, 0), a[1] = PyTuple_GET_ITEM(norm, 1);
        if (!append) a[2] = PyTuple_GET_ITEM(norm, 2);
    }
done:
    vals_release(&v);
    give(s);
    Py_XDECREF(norm);
    Py_XDECREF(zero);
    return result;
}

static PyObject *st_set(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return set_impl(s, args, nargs, kw, 0);
}

static PyObject *st_append(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return set_impl(s, args, nargs, kw, 1);
}

static PyObject *st_set_row(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"row", "values"};
    PyObject *a[2] = {NULL, NULL};
    if (parse("set_row", names, 2, 2, args, nargs, kwnames, a) < 0) return NULL;
    if (take(s, "set_row") < 0) return NULL;
    PyObject *norm = NULL, *result = NULL;
    Vals v = {0};
    for (int attempt = 0;; attempt++) {
        Py_ssize_t r;
        int ok = plain_index(a[0], s->rows, &r);
        int pv = ok ? plain_values(s, a[1], &v) : 0;
        if (pv < 0) goto done;
        ok = ok && pv && (s->wide ? v.k <= s->width : v.k == 1);
        if (ok) {
            Py_ssize_t k = v.k;
            if (!s->wide) {
                memmove(at(s, r), v.data, (size_t)s->isz);
                if (push_run(s, r, r + 1) < 0) goto done;
            } else {
                int64_t *ln = lens(s), old = ln[r], start = (int64_t)r * s->width;
                if (k) memmove(at(s, start), v.data, (size_t)(k * s->isz));
                if (old > k) fill_pad(s, start + k, old - k);
                ln[r] = k;
                if (k > s->colmax) s->colmax = k;
                if (push_run(s, start, start + (k > old ? k : old)) < 0) goto done;
            }
            if (r >= s->top) s->top = r + 1;
            result = Py_NewRef(Py_None);
            goto done;
        }
        vals_release(&v);
        if (attempt) {
            unplain("set_row");
            goto done;
        }
        Py_XSETREF(norm, normalize(s, "set_row", a, 2));
        if (!norm) goto done;
        a[0] = PyTuple_GET_ITEM(norm, 0), a[1] = PyTuple_GET_ITEM(norm, 1);
    }
done:
    vals_release(&v);
    give(s);
    Py_XDECREF(norm);
    return result;
}

/* Rows of a one- or two-row op (clear_row, move_row, swap_rows), in plain form (normalized once). */
static int rows_of_args(Staged *s, const char *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        const char *const *names, int n, Py_ssize_t *out) {
    PyObject *a[2] = {NULL, NULL};
    if (parse(op, names, n, n, args, nargs, kwnames, a) < 0) return -1;
    int ok = 1;
    for (int i = 0; i < n; i++) ok = ok && plain_index(a[i], s->rows, &out[i]);
    if (ok) return 0;
    PyObject *norm = normalize(s, op, a, n);
    if (!norm) return -1;
    ok = 1;
    for (int i = 0; i < n; i++) ok = ok && plain_index(PyTuple_GET_ITEM(norm, i), s->rows, &out[i]);
    Py_DECREF(norm);
    if (!ok) {
        unplain(op);
        return -1;
    }
    return 0;
}

/* A write naming only rows (clear_row, move_row, swap_rows): guard, rows in plain form, then apply(rows). */
static PyObject *row_op(Staged *s, const char *op, const char *const *names, int n, PyObject *const *args,
                        Py_ssize_t nargs, PyObject *kwnames, int (*apply)(Staged *, const Py_ssize_t *)) {
    Py_ssize_t r[2];
    if (take(s, op) < 0) return NULL;
    int err = rows_of_args(s, op, args, nargs, kwnames, names, n, r);
    if (!err) err = apply(s, r);
    give(s);
    if (err) return NULL;
    Py_RETURN_NONE;
}

static int do_clear_row(Staged *s, const Py_ssize_t *r) {
    if (!s->wide) {
        fill_pad(s, r[0], 1);
        return push_run(s, r[0], r[0] + 1);
    }
    int64_t *ln = lens(s), old = ln[r[0]], start = (int64_t)r[0] * s->width;
    if (!old) return 0;
    fill_pad(s, start, old);
    ln[r[0]] = 0;
    return push_run(s, start, start + old);
}

static int do_move_row(Staged *s, const Py_ssize_t *r) {
    Py_ssize_t src = r[0], dst = r[1];
    if (src == dst) return 0;
    int err;
    if (s->wide) {
        int64_t *ln = lens(s), k = ln[src], old = ln[dst], w = s->width;
        if (k) memmove(at(s, dst * w), at(s, src * w), (size_t)(k * s->isz));
        if (old > k) fill_pad(s, dst * w + k, old - k);
        ln[dst] = k;
        err = push_run(s, dst * w, dst * w + (k > old ? k : old));
    } else {
        memmove(at(s, dst), at(s, src), (size_t)s->isz);
        err = push_run(s, dst, dst + 1);
    }
    if (dst >= s->top) s->top = dst + 1;
    return err;
}

static void swap_bytes(char *x, char *y, size_t n) {
    char t[256];
    while (n) {
        size_t m = n < sizeof t ? n : sizeof t;
        memcpy(t, x, m), memcpy(x, y, m), memcpy(y, t, m);
        x += m, y += m, n -= m;
    }
}

static int do_swap_rows(Staged *s, const Py_ssize_t *r) {
    Py_ssize_t i = r[0], j = r[1];
    if (i == j) return 0;
    int64_t w = s->width, k = 1;
    if (s->wide) {
        int64_t *ln = lens(s), t = ln[i];
        k = ln[i] > ln[j] ? ln[i] : ln[j];
        ln[i] = ln[j], ln[j] = t;
    }
    swap_bytes(at(s, i * w), at(s, j * w), (size_t)(k * s->isz));
    if (i + 1 > s->top) s->top = i + 1;
    if (j + 1 > s->top) s->top = j + 1;
    return push_run(s, i * w, i * w + k) || push_run(s, j * w, j * w + k) ? -1 : 0;
}

static PyObject *st_clear_row(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"row"};
    return row_op(s, "clear_row", names, 1, args, nargs, kwnames, do_clear_row);
}

static PyObject *st_move_row(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"src", "dst"};
    return row_op(s, "move_row", names, 2, args, nargs, kwnames, do_move_row);
}

static PyObject *st_swap_rows(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"a", "b"};
    return row_op(s, "swap_rows", names, 2, args, nargs, kwnames, do_swap_rows);
}

/* Scatter's plain rows, cols (2-D) and values copied into one owned block (*own), the views pointed at it:
 * the checks and the writes read the copy, so indices or values that view the host state cannot change
 * between the check and the write. */
static int copy_args(const Staged *s, Vals *rv, Vals *cv, Vals *v, char **own) {
    size_t k = (size_t)rv->k, isz = (size_t)s->isz;
    *own = PyMem_Malloc(k * (s->wide ? 16 : 8) + k * isz);
    if (!*own) {
        PyErr_NoMemory();
        return -1;
    }
    char *p = *own;
    memcpy(p, rv->data, k * 8), rv->data = p, p += k * 8;
    if (s->wide) memcpy(p, cv->data, k * 8), cv->data = p, p += k * 8;
    memcpy(p, v->data, k * isz), v->data = p;
    return 0;
}

static PyObject *st_scatter(Staged *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"rows", "values", "cols"};
    PyObject *a[3] = {NULL, NULL, NULL};
    if (parse("scatter", names, 3, 2, args, nargs, kwnames, a) < 0) return NULL;
    if (!a[2]) a[2] = Py_None;
    if (take(s, "scatter") < 0) return NULL;
    PyObject *norm = NULL, *result = NULL;
    Vals rv = {0}, cv = {0}, v = {0};
    char *own = NULL;
    for (int attempt = 0;; attempt++) {
        int ok = plain_int64(s, a[0], &rv);
        int pv = ok ? plain_values(s, a[1], &v) : 0;
        if (pv < 0) goto done;
        ok = ok && pv && v.k == rv.k;
        if (ok && s->wide) ok = a[2] != Py_None && plain_int64(s, a[2], &cv) && cv.k == rv.k;
        if (ok && !s->wide) ok = a[2] == Py_None;
        Py_ssize_t k = rv.k;
        if (ok && k && copy_args(s, &rv, &cv, &v, &own) < 0) goto done;
        const int64_t *rows = (const int64_t *)rv.data, *cols = s->wide && ok ? (const int64_t *)cv.data : NULL;
        int64_t hi = -1, chi = -1;
        for (Py_ssize_t i = 0; ok && i < k; i++) {
            if (rows[i] < 0 || rows[i] >= s->rows) ok = 0;
            else if (rows[i] > hi) hi = rows[i];
            if (cols) {
                if (cols[i] < 0 || cols[i] >= s->width) ok = 0;
                else if (cols[i] > chi) chi = cols[i];
            }
        }
        if (ok) {
            if (k) {
                if (reserve_cells(s, k) < 0) goto done;
                int64_t *out = s->cells + s->ncells;
                if (s->wide) {
                    int64_t *ln = lens(s), w = s->width;
                    for (Py_ssize_t i = 0; i < k; i++) {
                        int64_t cell = rows[i] * w + cols[i];
                        memcpy(at(s, cell), v.data + i * s->isz, (size_t)s->isz);
                        if (cols[i] + 1 > ln[rows[i]]) ln[rows[i]] = cols[i] + 1;
                        out[i] = cell;
                    }
                    if (chi + 1 > s->colmax) s->colmax = chi + 1;
                } else {
                    for (Py_ssize_t i = 0; i < k; i++) {
                        memcpy(at(s, rows[i]), v.data + i * s->isz, (size_t)s->isz);
                        out[i] = rows[i];
                    }
                }
                s->ncells += k;
                if (hi >= s->top) s->top = hi + 1;
            }
            result = Py_NewRef(Py_None);
            goto done;
        }
        vals_release(&rv), vals_release(&cv), vals_release(&v);
        PyMem_Free(own), own = NULL;
        if (attempt) {
            unplain("scatter");
            goto done;
        }
        Py_XSETREF(norm, normalize(s, "scatter", a, 3));
        if (!norm) goto done;
        a[0] = PyTuple_GET_ITEM(norm, 0), a[1] = PyTuple_GET_ITEM(norm, 1), a[2] = PyTuple_GET_ITEM(norm, 2);
        if (a[0] == Py_None) { /* nothing to write (no rows) */
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
done:
    vals_release(&rv), vals_release(&cv), vals_release(&v);
    PyMem_Free(own);
    give(s);
    Py_XDECREF(norm);
    return result;
}

/* --------------------------------------------------------------------------------- changed cells */

static int64_t run_len(const Staged *s, Py_ssize_t i) {
    int64_t n = s->runs[2 * i + 1] - s->runs[2 * i];
    return n > 0 ? n : 0;
}

static PyObject *st_changed_into(Staged *s, PyObject *out) {
    Py_buffer b;
    if (PyObject_GetBuffer(out, &b, PyBUF_RECORDS) < 0) return NULL;
    int64_t need = s->ncells;
    for (Py_ssize_t i = 0; i < s->nruns; i++) need += run_len(s, i);
    if (b.ndim != 1 || b.itemsize != 8 || kind_of(&b) != K_SIGNED || b.shape[0] != need ||
        (need > 1 && b.strides && b.strides[0] != 8)) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "changed_into: pass a contiguous int64 array of %lld elements",
                     (long long)need);
        return NULL;
    }
    int64_t *p = b.buf;
    if (s->ncells) memcpy(p, s->cells, (size_t)s->ncells * sizeof(int64_t));
    p += s->ncells;
    for (Py_ssize_t i = 0; i < s->nruns; i++)
        for (int64_t j = s->runs[2 * i]; j < s->runs[2 * i + 1]; j++) *p++ = j;
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *st_single(Staged *s, PyObject *unused) {
    if (s->nruns != 1 || s->ncells) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)s->runs[0], (long long)s->runs[1]);
}

static PyObject *st_clear(Staged *s, PyObject *unused) {
    s->nruns = s->ncells = 0;
    Py_RETURN_NONE;
}

static PyObject *get_pending(Staged *s, void *c) { return PyBool_FromLong(s->nruns || s->ncells); }

static PyObject *get_nchanged(Staged *s, void *c) {
    int64_t need = s->ncells;
    for (Py_ssize_t i = 0; i < s->nruns; i++) need += run_len(s, i);
    return PyLong_FromLongLong(need);
}

/* The public face, kept by the Python checks (staged._Checks): one rule for both host states. */
static PyObject *get_name(Staged *s, void *c) { return PyObject_GetAttr(s->checks, s_name); }
static PyObject *get_host(Staged *s, void *c) { return PyObject_CallMethodNoArgs(s->checks, s_host_view); }
static PyObject *get_lengths(Staged *s, void *c) { return PyObject_CallMethodNoArgs(s->checks, s_lengths_view); }

static PyObject *st_repr(Staged *s) {
    PyObject *name = PyObject_GetAttr(s->checks, s_name);
    if (!name) return NULL;
    PyObject *r = PyUnicode_FromFormat("StagedBuffer(%R, pending=%s)", name, s->nruns || s->ncells ? "True" : "False");
    Py_DECREF(name);
    return r;
}

static PyObject *get_colmax(Staged *s, void *c) { return PyLong_FromLongLong(s->colmax); }
static PyObject *get_top(Staged *s, void *c) { return PyLong_FromLongLong(s->top); }

static int set_mark(PyObject *v, int64_t *dst, int64_t limit, const char *what) {
    if (!v) {
        PyErr_Format(PyExc_AttributeError, "%s cannot be deleted", what);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0 || x > limit) {
        PyErr_Format(PyExc_ValueError, "%s must lie in 0..%lld, got %lld", what, (long long)limit, x);
        return -1;
    }
    *dst = x;
    return 0;
}

static int put_colmax(Staged *s, PyObject *v, void *c) { return set_mark(v, &s->colmax, s->width, "colmax"); }
static int put_top(Staged *s, PyObject *v, void *c) { return set_mark(v, &s->top, s->rows, "top"); }

/* ---------------------------------------------------------------------------------------- commit */

typedef struct {
    Staged *s;
    Py_ssize_t live, shown, cols;
} Job;

/* 1: the value at flat index i lies within the bounds (and is no NaN); 0: not; -1: cannot say. */
static inline int cell_ok(const Staged *s, int64_t i) {
    const char *p = at(s, i);
    const Bounds *b = &s->b;
    switch (s->kind) {
    case K_SIGNED: {
        int64_t x;
        switch (s->isz) {
        case 1: { int8_t y; memcpy(&y, p, 1); x = y; } break;
        case 2: { int16_t y; memcpy(&y, p, 2); x = y; } break;
        case 4: { int32_t y; memcpy(&y, p, 4); x = y; } break;
        default: memcpy(&x, p, 8);
        }
        if (b->lk == 2 || (b->lk == 1 && x < b->lo)) return 0;
        if (b->hk == -2 || (b->hk == 1 && x > b->hi)) return 0;
        return 1;
    }
    case K_UNSIGNED: {
        uint64_t x;
        switch (s->isz) {
        case 1: { uint8_t y; memcpy(&y, p, 1); x = y; } break;
        case 2: { uint16_t y; memcpy(&y, p, 2); x = y; } break;
        case 4: { uint32_t y; memcpy(&y, p, 4); x = y; } break;
        default: memcpy(&x, p, 8);
        }
        if (b->lk == 2 || (b->lk == 1 && b->lo > 0 && x < (uint64_t)b->lo)) return 0;
        if (b->hk == -2 || (b->hk == 1 && (b->hi < 0 || x > (uint64_t)b->hi))) return 0;
        return 1;
    }
    case K_FLOAT: {
        double x;
        if (s->isz == 4) {
            float y;
            memcpy(&y, p, 4);
            x = y;
        } else if (s->isz == 8) {
            memcpy(&x, p, 8);
        } else {
            return -1;
        }
        if (isnan(x)) return 0;
        if (b->lk && x < b->flo) return 0;
        if (b->hk && x > b->fhi) return 0;
        return 1;
    }
    default:
        return -1;
    }
}

static int checks(const Staged *s) {
    if (s->kind == K_FLOAT) return 1;
    return s->b.lk != 0 || s->b.hk != 0;
}

/* Check (target NULL) or write (target given) the cells of one job; *moved counts the bytes written. */
static int visit(const Job *j, char *target, int64_t *moved) {
    const Staged *s = j->s;
    int64_t w = s->width, keep = j->live < j->shown ? j->live : j->shown, lim = keep * w, isz = s->isz;
    int check = !target && checks(s);
    if (!target && !check) return 1;
    for (Py_ssize_t i = 0; i < s->nruns; i++) {
        int64_t a = s->runs[2 * i], b = s->runs[2 * i + 1];
        if (b > lim) b = lim;
        if (b <= a) continue;
        if (target) {
            memcpy(target + a * isz, at(s, a), (size_t)((b - a) * isz));
            *moved += (b - a) * isz;
        } else {
            for (int64_t c = a; c < b; c++) {
                int ok = cell_ok(s, c);
                if (ok != 1) return ok;
            }
        }
    }
    for (Py_ssize_t i = 0; i < s->ncells; i++) {
        int64_t c = s->cells[i];
        if (c < 0) return -1; /* recorded only after its check: never here */
        if (c >= lim) continue;
        if (target) {
            memcpy(target + c * isz, at(s, c), (size_t)isz);
            *moved += isz;
        } else {
            int ok = cell_ok(s, c);
            if (ok != 1) return ok;
        }
    }
    for (int64_t r = j->shown; r < j->live; r++) { /* rows entering the live range: their used width */
        int64_t a = r * w, b = a + (s->wide ? lens(s)[r] : 1);
        if (target) {
            if (b > a) memcpy(target + a * isz, at(s, a), (size_t)((b - a) * isz));
            *moved += (b - a) * isz;
        } else {
            for (int64_t c = a; c < b; c++) {
                int ok = cell_ok(s, c);
                if (ok != 1) return ok;
            }
        }
    }
    return 1;
}

static int get_mark(PyObject *list, Py_ssize_t i, Py_ssize_t *out) {
    if (!PyList_Check(list) || i >= PyList_GET_SIZE(list)) return 0;
    Py_ssize_t v = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

static PyTypeObject StagedType;

/* A committed job's marks: rows_of[index] its live rows, cols_of[index] its column mark (index checked by
 * get_mark when the job was made). */
static int set_marks(const Job *j, PyObject *rows_of, PyObject *cols_of) {
    PyObject *rv = PyLong_FromSsize_t(j->live);
    PyObject *cv = PyLong_FromLongLong(j->live && j->s->wide ? j->s->colmax : 0);
    if (!rv || !cv) {
        Py_XDECREF(rv);
        Py_XDECREF(cv);
        return -1;
    }
    PyList_SetItem(rows_of, j->s->index, rv); /* steals */
    PyList_SetItem(cols_of, j->s->index, cv);
    return 0;
}

/* Every checked job's cells into its target, rows leaving the live range to the pad, then the marks: the
 * bytes written, or -1 with an error. */
static int64_t write_jobs(Job *jobs, Py_ssize_t nj, Py_buffer *tbs, PyObject *rows_of, PyObject *cols_of) {
    int64_t moved = 0;
    for (Py_ssize_t k = 0; k < nj; k++) {
        Job *j = &jobs[k];
        Staged *s = j->s;
        char *t = tbs[k].buf;
        visit(j, t, &moved);
        if (j->shown > j->live) {
            int64_t c = s->wide ? j->cols : 1, isz = s->isz;
            for (int64_t r = j->live; r < j->shown; r++)
                for (int64_t x = 0; x < c; x++) memcpy(t + (r * s->width + x) * isz, s->pad, (size_t)isz);
            moved += (j->shown - j->live) * c * isz;
        }
        s->nruns = s->ncells = 0;
    }
    for (Py_ssize_t k = 0; k < nj; k++) /* the marks, once every byte is written */
        if (set_marks(&jobs[k], rows_of, cols_of) < 0) return -1;
    return moved;
}

/* Core o's job for n live requests: 1 and j filled; 0 when it cannot say (no table, n past it, a mark out of
 * range); -1 with TypeError when o is not a Staged. */
static int job_of(PyObject *o, Py_ssize_t n, PyObject *rows_of, PyObject *cols_of, Job *j) {
    if (!PyObject_TypeCheck(o, &StagedType)) {
        PyErr_SetString(PyExc_TypeError, "cores must be Staged");
        return -1;
    }
    Staged *s = (Staged *)o;
    j->s = s;
    if (s->ntable < 0 || n >= s->ntable || !get_mark(rows_of, s->index, &j->shown) ||
        !get_mark(cols_of, s->index, &j->cols))
        return 0;
    j->live = (Py_ssize_t)s->table[n];
    return j->live >= 0 && j->live <= s->rows && j->shown >= 0 && j->shown <= s->rows && j->cols >= 0 &&
           j->cols <= s->width;
}

static PyObject *gb_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "commit(cores, n, rows_of, cols_of, targets, write) takes 6 arguments");
        return NULL;
    }
    PyObject *cores = args[0], *rows_of = args[2], *cols_of = args[3], *targets = args[4];
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    int write = PyObject_IsTrue(args[5]);
    if (write < 0) return NULL;
    if (!PyList_CheckExact(cores) || n < 0 || !PyList_Check(rows_of) || !PyList_Check(cols_of) ||
        !PyList_CheckExact(targets) || PyList_GET_SIZE(targets) != PyList_GET_SIZE(cores)) {
        PyErr_SetString(PyExc_TypeError, "commit: cores and targets (as many) lists, n >= 0, marks lists");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(cores);
    Job stack[16], *jobs = count <= 16 ? stack : PyMem_Malloc((size_t)count * sizeof(Job));
    Py_buffer tb[16], *tbs = count <= 16 ? tb : PyMem_Malloc((size_t)count * sizeof(Py_buffer));
    if (!jobs || !tbs) {
        if (jobs != stack) PyMem_Free(jobs);
        if (tbs != tb) PyMem_Free(tbs);
        return PyErr_NoMemory();
    }
    Py_ssize_t nj = 0, held = 0;
    PyObject *result = NULL;
    /* Resolve every job and its target (range- and size-checked) before anything is read or written. */
    for (Py_ssize_t i = 0; i < count; i++) {
        Job *j = &jobs[nj];
        int got = job_of(PyList_GET_ITEM(cores, i), n, rows_of, cols_of, j);
        if (got <= 0 || !j->s->b.known) {
            if (got >= 0) result = Py_NewRef(Py_None); /* the caller's path */
            goto done;
        }
        Staged *s = j->s;
        if (!(s->nruns || s->ncells) && j->live == j->shown) continue;
        if (!write) {
            nj++;
            continue;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(targets, i), &tbs[nj], PyBUF_RECORDS) < 0) goto done;
        held++;
        Py_buffer *b = &tbs[nj];
        if (b->ndim != 1 || b->itemsize != s->isz || b->shape[0] != s->rows * s->width ||
            (b->shape[0] > 1 && b->strides && b->strides[0] != b->itemsize)) {
            PyErr_SetString(PyExc_ValueError, "commit: a target is not the flat, contiguous twin of its host state");
            goto done;
        }
        nj++;
    }
    if (!write) { /* every check; nothing written */
        for (Py_ssize_t k = 0; k < nj; k++) {
            int ok = visit(&jobs[k], NULL, NULL);
            if (ok != 1) {
                result = ok == 0 ? Py_NewRef(Py_False) : Py_NewRef(Py_None);
                goto done;
            }
        }
        result = Py_NewRef(Py_True);
        goto done;
    }
    int64_t moved = write_jobs(jobs, nj, tbs, rows_of, cols_of);
    if (moved < 0) goto done;
    result = PyLong_FromLongLong(moved);
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&tbs[k]);
    if (jobs != stack) PyMem_Free(jobs);
    if (tbs != tb) PyMem_Free(tbs);
    return result;
}

/* ------------------------------------------------------------------------------------------- type */

static int st_init(Staged *s, PyObject *args, PyObject *kwds) {
    PyObject *host, *lensobj, *pad, *lo, *hi, *table, *lock, *checks, *ndarray;
    Py_ssize_t index;
    long long colmax, top;
    if (!PyArg_ParseTuple(args, "OOSOOOnOLLOO!:Staged", &host, &lensobj, &pad, &lo, &hi, &table, &index, &lock,
                          &colmax, &top, &checks, &PyType_Type, &ndarray))
        return -1;
    if (s->held) {
        PyErr_SetString(PyExc_RuntimeError, "Staged: already initialized");
        return -1;
    }
    if (PyObject_GetBuffer(host, &s->host, PyBUF_RECORDS | PyBUF_C_CONTIGUOUS) < 0) return -1;
    s->held = 1;
    Py_buffer *h = &s->host;
    s->kind = kind_of(h);
    s->isz = h->itemsize;
    if (s->kind == K_NONE || (h->ndim != 1 && h->ndim != 2) || s->isz > 8 ||
        PyBytes_GET_SIZE(pad) != s->isz || index < 0) {
        PyErr_SetString(PyExc_ValueError, "Staged: host must be a 1-D or 2-D numeric array, pad its item's bytes");
        return -1;
    }
    s->wide = h->ndim == 2;
    s->rows = h->shape[0];
    s->width = s->wide ? h->shape[1] : 1;
    memcpy(s->pad, PyBytes_AS_STRING(pad), (size_t)s->isz);
    if (s->wide) {
        if (PyObject_GetBuffer(lensobj, &s->lensb, PyBUF_RECORDS | PyBUF_C_CONTIGUOUS) < 0) return -1;
        s->lheld = 1;
        if (s->lensb.ndim != 1 || s->lensb.itemsize != 8 || kind_of(&s->lensb) != K_SIGNED ||
            s->lensb.shape[0] != s->rows) {
            PyErr_SetString(PyExc_ValueError, "Staged: lens must be an int64 array of one element per row");
            return -1;
        }
    } else if (lensobj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "Staged: a 1-D host state has no lens");
        return -1;
    }
    Bounds *b = &s->b;
    b->known = 1;
    b->lk = bound_of(lo, &b->lo, &b->flo, &b->known);
    b->hk = bound_of(hi, &b->hi, &b->fhi, &b->known);
    if (b->lk == -1 || b->hk == -1) return -1;
    if (s->kind != K_FLOAT && (b->lk == 3 || b->hk == 3)) b->known = 0;
    if (s->kind != K_FLOAT && b->known == -1) b->known = 1; /* the double is not used */
    if (s->kind == K_FLOAT) {
        b->known = b->known != -1; /* floats compare as doubles: a bound reads unless a double cannot hold it */
        b->lk = b->lk != 0, b->hk = b->hk != 0;
    } else if (s->kind == K_BOOL) {
        b->known = b->lk == 0 && b->hk == 0;
    }
    s->ntable = -1;
    if (table != Py_None) {
        PyObject *seq = PySequence_Fast(table, "Staged: table must be a sequence of ints");
        if (!seq) return -1;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
        s->table = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(int64_t));
        if (!s->table) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
            if (x == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            s->table[i] = x;
        }
        Py_DECREF(seq);
        s->ntable = k;
    }
    s->index = index;
    Py_INCREF(lock);
    s->lock = lock;
    if (!(s->acquire = PyObject_GetAttr(lock, s_acquire)) || !(s->release = PyObject_GetAttr(lock, s_release)))
        return -1;
    s->checks = Py_NewRef(checks);
    s->ndarray = (PyTypeObject *)Py_NewRef(ndarray);
    if (colmax < 0 || colmax > s->width || top < 0 || top > s->rows) {
        PyErr_SetString(PyExc_ValueError, "Staged: colmax or top outside the host state");
        return -1;
    }
    s->colmax = colmax, s->top = top;
    return 0;
}

static int st_traverse(Staged *s, visitproc visit, void *arg) {
    Py_VISIT(s->lock);
    Py_VISIT(s->acquire);
    Py_VISIT(s->release);
    Py_VISIT(s->checks);
    Py_VISIT((PyObject *)s->ndarray);
    return 0;
}

static int st_clear_refs(Staged *s) {
    Py_CLEAR(s->lock);
    Py_CLEAR(s->acquire);
    Py_CLEAR(s->release);
    Py_CLEAR(s->checks);
    Py_CLEAR(s->ndarray);
    return 0;
}

static void st_dealloc(Staged *s) {
    PyObject_GC_UnTrack(s);
    if (s->held) PyBuffer_Release(&s->host);
    if (s->lheld) PyBuffer_Release(&s->lensb);
    s->held = s->lheld = 0;
    PyMem_Free(s->table);
    PyMem_Free(s->runs);
    PyMem_Free(s->cells);
    st_clear_refs(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

#define FAST (METH_FASTCALL | METH_KEYWORDS)
#define CF(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef st_methods[] = {
    {"set", CF(st_set), FAST, "set(row, values, col=0): see graphbuf.buffers.staged.StagedBuffer.set."},
    {"append", CF(st_append), FAST, "append(row, values): see graphbuf.buffers.staged.StagedBuffer.append."},
    {"set_row", CF(st_set_row), FAST, "set_row(row, values): see graphbuf.buffers.staged.StagedBuffer.set_row."},
    {"clear_row", CF(st_clear_row), FAST, "clear_row(row): see graphbuf.buffers.staged.StagedBuffer.clear_row."},
    {"move_row", CF(st_move_row), FAST, "move_row(src, dst): see graphbuf.buffers.staged.StagedBuffer.move_row."},
    {"swap_rows", CF(st_swap_rows), FAST, "swap_rows(a, b): see graphbuf.buffers.staged.StagedBuffer.swap_rows."},
    {"scatter", CF(st_scatter), FAST, "scatter(rows, values, cols=None): see graphbuf.buffers.staged.StagedBuffer.scatter."},
    {"changed_into", CF(st_changed_into), METH_O, "Every changed flat index into a contiguous int64 array."},
    {"single", CF(st_single), METH_NOARGS, "(start, stop) of the one changed run, or None."},
    {"clear", CF(st_clear), METH_NOARGS, "Forget the changes (after a commit)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef st_getset[] = {
    {"name", (getter)get_name, NULL, "The buffer's name.", NULL},
    {"host", (getter)get_host, NULL, "The host state, read-only (StagedBuffer.host).", NULL},
    {"lengths", (getter)get_lengths, NULL, "2-D: per row, the columns that may hold values (StagedBuffer.lengths).",
     NULL},
    {"pending", (getter)get_pending, NULL, "True while staged writes wait for a refresh to commit them.", NULL},
    {"nchanged", (getter)get_nchanged, NULL, "Changed flat indices (with repeats).", NULL},
    {"colmax", (getter)get_colmax, (setter)put_colmax, "Bound of every row's length.", NULL},
    {"top", (getter)get_top, (setter)put_top, "Rows at and past top hold the pad.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StagedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "graphbuf.buffers._native.Staged",
    .tp_basicsize = sizeof(Staged),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One staged buffer's host state and changed cells, in C: a graphbuf.buffers.staged.StagedBuffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)st_init,
    .tp_dealloc = (destructor)st_dealloc,
    .tp_traverse = (traverseproc)st_traverse,
    .tp_clear = (inquiry)st_clear_refs,
    .tp_repr = (reprfunc)st_repr,
    .tp_methods = st_methods,
    .tp_getset = st_getset,
};

/* ------------------------------------------------------------------------------------------ pack */

/* Spans of at least RUN_MIN words go to the run area, placed by one device copy each; shorter ones as
 * (slab word index, word) pairs, placed together by one indexed write. */
#define RUN_MIN 2048

/* A run's words, copied into the run area once the pairs' bucket (where that area starts) is known. */
typedef struct {
    const char *src, *pad; /* n words from src, or (src NULL) the pad's per words repeated */
    int64_t per, n;
} Run;

typedef struct {
    int64_t *idx;
    int32_t *val;
    Py_ssize_t k, cap; /* pairs packed (counted past cap: the caller retries with room) */
    Py_ssize_t rk;     /* run words (counted past cap) */
    PyObject *runs;    /* [(slab word, words)] in run-area order */
    Run *rs;           /* their words, nrs of them in room for rroom */
    Py_ssize_t nrs, rroom;
    int rs_owned; /* rs was allocated here (else the caller's stack) */
} Words;

/* n words from src, or (src NULL) the pad's per words repeated, to d. */
static void put_words(int32_t *d, const char *src, const char *pad, int64_t per, int64_t n) {
    if (src) {
        memcpy(d, src, (size_t)n * 4);
    } else if (per == 1) {
        int32_t v;
        memcpy(&v, pad, 4);
        for (int64_t i = 0; i < n; i++) d[i] = v;
    } else {
        for (int64_t i = 0; i < n; i++) memcpy(d + i, pad + 4 * (i % per), 4);
    }
}

/* One more run in o->rs (grown on the heap past the caller's room); -1 with an error. */
static int push_run_words(Words *o, const char *src, const char *pad, int64_t per, int64_t n) {
    if (o->nrs == o->rroom) {
        Py_ssize_t room = 2 * o->rroom;
        Run *rs = PyMem_Malloc((size_t)room * sizeof(Run));
        if (!rs) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(rs, o->rs, (size_t)o->nrs * sizeof(Run));
        if (o->rs_owned) PyMem_Free(o->rs);
        o->rs = rs;
        o->rroom = room;
        o->rs_owned = 1;
    }
    o->rs[o->nrs++] = (Run){src, pad, per, n};
    return 0;
}

/* n words to slab words dst..: from src, or (src NULL) the pad's per words repeated. A run's words are
 * copied later (put_runs), straight to where the upload reads them. */
static int emit_span(Words *o, int64_t dst, const char *src, const char *pad, int64_t per, int64_t n) {
    if (n >= RUN_MIN) {
        o->rk += n;
        PyObject *t = PyTuple_New(2), *a = PyLong_FromLongLong(dst), *b = PyLong_FromLongLong(n);
        if (!t || !a || !b || push_run_words(o, src, pad, per, n) < 0) {
            Py_XDECREF(t);
            Py_XDECREF(a);
            Py_XDECREF(b);
            return -1;
        }
        PyTuple_SET_ITEM(t, 0, a); /* steals each */
        PyTuple_SET_ITEM(t, 1, b);
        int err = PyList_Append(o->runs, t) < 0;
        Py_DECREF(t);
        return err ? -1 : 0;
    }
    int64_t m = o->k >= o->cap ? 0 : (o->cap - o->k < n ? o->cap - o->k : n); /* what fits (counted: n) */
    int64_t *idx = o->idx + o->k;
    for (int64_t i = 0; i < m; i++) idx[i] = dst + i;
    put_words(o->val + o->k, src, pad, per, m);
    o->k += n;
    return 0;
}

/* The cells one job's commit writes (changed cells of live rows, rows entering the live range over their
 * used width, rows leaving it over the cleared columns as pad), as word spans; -1 with an error. */
static int pack_job(const Job *j, int64_t base, Words *o) {
    const Staged *s = j->s;
    int64_t w = s->width, keep = j->live < j->shown ? j->live : j->shown, lim = keep * w, per = s->isz / 4;
    for (Py_ssize_t i = 0; i < s->nruns; i++) {
        int64_t a = s->runs[2 * i], b = s->runs[2 * i + 1] < lim ? s->runs[2 * i + 1] : lim;
        if (b > a && emit_span(o, base + a * per, at(s, a), NULL, per, (b - a) * per) < 0) return -1;
    }
    for (Py_ssize_t i = 0; i < s->ncells; i++) {
        int64_t c = s->cells[i];
        if (c >= 0 && c < lim && emit_span(o, base + c * per, at(s, c), NULL, per, per) < 0) return -1;
    }
    for (int64_t r = j->shown; r < j->live; r++) {
        int64_t a = r * w, n = s->wide ? lens(s)[r] : 1;
        if (n > 0 && emit_span(o, base + a * per, at(s, a), NULL, per, n * per) < 0) return -1;
    }
    int64_t cc = s->wide ? j->cols : 1;
    for (int64_t r = j->live; r < j->shown; r++)
        if (cc > 0 && emit_span(o, base + r * w * per, NULL, s->pad, per, cc * per) < 0) return -1;
    return 0;
}

/* Rectangles (word start, rows, row words, stride words) of image as words (rows back to back as one span);
 * -1 with an error for a bad one. */
static int pack_rects(PyObject *rects, const int32_t *image, Py_ssize_t nwords, Words *o) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rects); i++) {
        long long v[4];
        PyObject *t = PyList_GET_ITEM(rects, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_TypeError, "pack: a rect is (word start, rows, row words, stride words)");
            return -1;
        }
        for (int j = 0; j < 4; j++) {
            v[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, j));
            if (v[j] == -1 && PyErr_Occurred()) return -1;
        }
        long long start = v[0], rows = v[1], len = v[2], stride = v[3];
        if (start < 0 || rows < 0 || len < 0 || stride < len ||
            (rows && len && start + (rows - 1) * stride + len > nwords)) {
            PyErr_SetString(PyExc_ValueError, "pack: a rect reaches outside the image");
            return -1;
        }
        if (len == stride && rows > 1) { /* rows back to back: one span */
            len *= rows;
            rows = 1;
        }
        for (long long r = 0; r < rows && len; r++) {
            int64_t at = start + r * stride;
            if (emit_span(o, at, (const char *)(image + at), NULL, 1, len) < 0) return -1;
        }
    }
    return 0;
}

/* Every core's staged cells into o (marks 0), or the marks updated and the changes forgotten (marks 1):
 * 1; 0 for a core it cannot read (nothing changed); -1 with an error. */
static int pack_cores(PyObject *cores, Py_ssize_t n, PyObject *rows_of, PyObject *cols_of, PyObject *bases, Words *o,
                      int marks) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cores); i++) {
        Job j;
        int got = job_of(PyList_GET_ITEM(cores, i), n, rows_of, cols_of, &j);
        if (got <= 0) return got;
        if (j.s->isz % 4) return 0; /* not 4-byte words: nothing packed, the Python upload writes them all */
        Staged *s = j.s;
        long long base = PyLong_AsLongLong(PyList_GET_ITEM(bases, i));
        if (base == -1 && PyErr_Occurred()) return -1;
        if (!(s->nruns || s->ncells) && j.live == j.shown) continue;
        if (!marks) {
            if (pack_job(&j, base, o) < 0) return -1;
            continue;
        }
        if (set_marks(&j, rows_of, cols_of) < 0) return -1;
        s->nruns = s->ncells = 0;
    }
    return 1;
}

/* pack(rects, image, cores, n, rows_of, cols_of, bases, arena) -> words | -words needed | None
 *     A refresh's writes for one upload: first the rectangles the full sources touched, each (word start,
 *     rows, row words, row stride in words) of the slab viewed as 4-byte words (rows back to back are one
 *     span), their words read from image (the upload copy the refresh wrote them into, laid out as the
 *     slab); then, after commit(..., False) passed, the cells every core's staged commit writes (bases[i]:
 *     the buffer's offset in words). Into arena (contiguous bytes, room for cap = len / 16 pairs and cap run
 *     words): spans shorter than RUN_MIN words as k slab word indices (int64 at [0, 8b)) then their words
 *     (at [8b, 12b)), padded to b (0 without pairs, 64, or k rounded up to an eighth of the power of two
 *     below it) with copies of the last pair, for one indexed write of the slab viewed as int32 words;
 *     longer spans (a joining request's row, a wide rectangle's rows) as their words from 12b on, copied
 *     there once b is known, one device copy each, listed in runs as (slab word, words).
 *     Returns (k, b, runs), the cores' marks updated and their changes forgotten; or -needed with nothing
 *     changed when the arena holds fewer; or None, nothing changed, for a core it cannot read or an element
 *     size that is not a multiple of 4 (the Python upload then runs). */
static PyObject *gb_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "pack(rects, image, cores, n, rows_of, cols_of, bases, arena) takes 8 arguments");
        return NULL;
    }
    PyObject *rects = args[0], *image = args[1];
    args += 2; /* the staged part: cores, n, rows_of, cols_of, bases, arena */
    PyObject *cores = args[0], *rows_of = args[2], *cols_of = args[3], *bases = args[4];
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(cores) || n < 0 || !PyList_Check(rows_of) || !PyList_Check(cols_of) ||
        !PyList_CheckExact(bases) || PyList_GET_SIZE(bases) != PyList_GET_SIZE(cores)) {
        PyErr_SetString(PyExc_TypeError, "pack: cores and bases (as many) lists, n >= 0, marks lists");
        return NULL;
    }
    if (!PyList_CheckExact(rects)) {
        PyErr_SetString(PyExc_TypeError, "pack: rects must be a list");
        return NULL;
    }
    Py_buffer ab, img;
    if (PyObject_GetBuffer(image, &img, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[5], &ab, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&img);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t cap = ab.len / 16;
    Run room[8];
    Words o = {.idx = (int64_t *)ab.buf, .val = (int32_t *)((char *)ab.buf + 8 * cap), .cap = cap,
               .runs = PyList_New(0), .rs = room, .rroom = 8};
    if (!o.runs) goto out;
    if ((uintptr_t)ab.buf % 8 || (uintptr_t)img.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "pack: the arena must be 8-byte aligned, the image 4-byte aligned");
        goto out;
    }
    if (pack_rects(rects, (const int32_t *)img.buf, img.len / 4, &o) < 0) goto out;
    int ok = pack_cores(cores, n, rows_of, cols_of, bases, &o, 0); /* pack (and count) */
    if (ok <= 0) {
        if (ok == 0) result = Py_NewRef(Py_None);
        goto out;
    }
    if (o.k > o.cap || o.rk > o.cap) {
        result = PyLong_FromSsize_t(-(o.k > o.rk ? o.k : o.rk));
        goto out;
    }
    /* Padded to a bucket b with copies of the last pair (the same index with the same word), so the
     * caller's views of each bucket are made once: 64, or k rounded up to an eighth of the power of two
     * below it (at most 1/8 of the pairs are padding; at most 8 buckets per octave). */
    Py_ssize_t b = 0;
    if (o.k) {
        Py_ssize_t q = 8;
        while (q * 16 <= o.k) q <<= 1;
        b = o.k <= 64 ? 64 : (o.k + q - 1) / q * q;
        if (b > cap) {
            PyErr_SetString(PyExc_ValueError, "pack: the arena's room must be a power of two words (>= 64)");
            goto out;
        }
        for (Py_ssize_t i = o.k; i < b; i++) o.idx[i] = o.idx[o.k - 1], o.val[i] = o.val[o.k - 1];
        memmove((char *)ab.buf + 8 * b, o.val, (size_t)b * 4); /* the words right after the indices */
    }
    int32_t *d = (int32_t *)((char *)ab.buf + 12 * b); /* then the run area: 12 b + 4 rk <= 16 cap */
    for (Py_ssize_t i = 0; i < o.nrs; i++) {
        put_words(d, o.rs[i].src, o.rs[i].pad, o.rs[i].per, o.rs[i].n);
        d += o.rs[i].n;
    }
    if (pack_cores(cores, n, rows_of, cols_of, bases, &o, 1) < 0) goto out; /* the marks, once all fits */
    result = PyTuple_New(3);
    PyObject *kv = PyLong_FromSsize_t(o.k), *bv = PyLong_FromSsize_t(b);
    if (!result || !kv || !bv) {
        Py_CLEAR(result);
        Py_XDECREF(kv);
        Py_XDECREF(bv);
        goto out;
    }
    PyTuple_SET_ITEM(result, 0, kv); /* steals each */
    PyTuple_SET_ITEM(result, 1, bv);
    PyTuple_SET_ITEM(result, 2, Py_NewRef(o.runs));
out:
    if (o.rs_owned) PyMem_Free(o.rs);
    Py_XDECREF(o.runs);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&img);
    return result;
}

static PyMethodDef staged_methods[] = {
    {"commit", CF(gb_commit), METH_FASTCALL, "Check (write False) or write (True) the staged cells of a refresh."},
    {"pack", CF(gb_pack), METH_FASTCALL, "A refresh's writes as slab words, for one upload."},
    {NULL, NULL, 0, NULL},
};

/* Adds Staged, commit and pack to the backend's module (graphbuf.buffers._native, made in _native.c). */
int gb_staged_init(PyObject *mod) {
    if (PyType_Ready(&StagedType) < 0) return -1;
    s_acquire = PyUnicode_InternFromString("acquire");
    s_release = PyUnicode_InternFromString("release");
    s_normalize = PyUnicode_InternFromString("_normalize");
    s_busy = PyUnicode_InternFromString("_busy");
    s_name = PyUnicode_InternFromString("name");
    s_host_view = PyUnicode_InternFromString("host_view");
    s_lengths_view = PyUnicode_InternFromString("lengths_view");
    if (!s_acquire || !s_release || !s_normalize || !s_busy || !s_name || !s_host_view || !s_lengths_view) return -1;
    if (PyModule_AddFunctions(mod, staged_methods) < 0) return -1;
    return PyModule_AddObjectRef(mod, "Staged", (PyObject *)&StagedType);
}
