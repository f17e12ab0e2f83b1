/* graphbuf.buffers._native: a refresh's value check and live-row write in C (buffer protocol, no numpy C API).
 *
 * fit(arr, rows, width, lo, hi) -> True | False | None
 *     Are the values of arr[:rows, :width] (2-D) or arr[:rows] (1-D) within lo..hi (None: unbounded)?
 *     None when this kernel does not check the dtype (floats: the caller looks for NaN) or a bound is not
 *     an int. Reads memory only.
 *
 * accept(arr, ndim, cap_rows, cap_cols, lo, hi) -> (rows, width) | None
 *     The whole of an integer source when it needs no more checks (layout, rows and columns within the
 *     capacity, values within lo..hi); None otherwise, errors included.
 *
 * accept_all(sources, slots, size, n, prepared, ndarray) -> [Prepared] | None
 *     accept for every source of a mapping in one call (exact numpy arrays of a dtype their slot casts
 *     safely, at a capture size, rows agreeing with n live requests unless n is None); None when any
 *     needs the general path.
 *
 * write(targets, items, ends, pads, rows_of, cols_of) -> moved bytes | None
 *     The live-row write of graphbuf.buffers.commit.write_live for every item, the same cells and values:
 *     items are (slot, host, device, n, w) tuples whose host[:n, :w] is the live data (host None: written
 *     on the device later); targets[i], ends[i], pads[i] (pad bytes), rows_of[i], cols_of[i] (high-water
 *     marks, updated) are indexed by slot.index, one item per slot. None, with nothing written, when an item
 *     needs a cast this kernel does not do, its source is misaligned, or a source shares bytes with a buffer
 *     this write touches (the caller then takes the numpy path).
 *
 * write(targets, items, ends, pads, rows_of, cols_of, words_of, limit) -> (moved, rects, words, rest) | None
 *     The same write, and the rectangles a packed upload reads (graphbuf.buffers.backend.Backend.write_words,
 *     the same result): words_of[i] is slot i's (word start, words per element, row stride in words), or
 *     None when it does not pack as 4-byte words. Per item, from the marks before the write, its rectangle
 *     r x c (r = max(n, end if n, rows), c = max(w, cols), 1 for a 1-D buffer) goes into rects as (word
 *     start, r, c x words per element, row stride) when it is not empty and holds at most limit words, and
 *     words counts them; otherwise rest gets (item, end, r, c); an item with a device source (item[2] not
 *     None) whose rectangle packed gets (item, end, 0, c) in rest too (its live cells are copied later).
 *
 * Every region is checked against the buffers' shapes before the first byte is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* GB_PORTABLE builds what a non-x86 host (an aarch64 Ascend server) builds: no streaming stores, no clones. */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(GB_PORTABLE)
#include <emmintrin.h>
#define GB_STREAM 1
#endif

/* Reductions built for AVX2 and SSE4.1 too (SSE2 has no 32-bit integer min/max), chosen at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(GB_PORTABLE)
#define GB_CLONES __attribute__((target_clones("avx2", "sse4.1", "default")))
#else
#define GB_CLONES
#endif

#include "_kinds.h"

/* A 1-D or 2-D region view: base, rows, row stride (bytes), elements per row. */
typedef struct {
    Py_buffer view;
    int held;
    int kind;
    Py_ssize_t isz;
    Py_ssize_t nrows, ncols; /* shape; ncols 1 for 1-D */
    Py_ssize_t rstride;      /* bytes between rows */
    int ndim;
    int aligned; /* buf and row stride are multiples of the item size */
} Arr;

static int arr_get(PyObject *obj, Arr *a, int writable) {
    a->held = 0;
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    a->held = 1;
    Py_buffer *v = &a->view;
    a->kind = kind_of(v);
    a->isz = v->itemsize;
    a->ndim = v->ndim;
    if (v->ndim == 1) {
        a->nrows = v->shape[0];
        a->ncols = 1;
        a->rstride = v->strides ? v->strides[0] : v->itemsize;
    } else if (v->ndim == 2) {
        a->nrows = v->shape[0];
        a->ncols = v->shape[1];
        a->rstride = v->strides ? v->strides[0] : v->shape[1] * v->itemsize;
        /* elements of a row must be contiguous (numpy gives size-1 and empty dims any stride) */
        if (v->strides && v->shape[1] > 1 && v->shape[0] > 0 && v->strides[1] != v->itemsize) {
            a->kind = K_NONE;
        }
    } else { /* 0-d or more than 2-D: no region of it is read */
        a->kind = K_NONE;
        a->nrows = a->ncols = a->rstride = 0;
    }
    if (v->ndim == 1 && v->strides && v->shape[0] > 1 && v->strides[0] != v->itemsize) a->kind = K_NONE;
    a->aligned = v->itemsize > 0 && (uintptr_t)v->buf % (uintptr_t)v->itemsize == 0 && a->rstride % v->itemsize == 0;
    return 0;
}

static void arr_release(Arr *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

static inline char *row_at(const Arr *a, Py_ssize_t r) { return (char *)a->view.buf + r * a->rstride; }

/* ---------------------------------------------------------------------------------------------- fit */

/* min and max over rows × cols of a region, as int64 (signed) or uint64 (unsigned/bool). */
/* min and max of n contiguous elements (one accumulator each: gcc vectorizes this form). */
#define MINMAXRUN(T)                                                                                 \
    GB_CLONES static void minmaxrun_##T(const T *p, Py_ssize_t n, T *lo, T *hi) {                    \
        T mn = *lo, mx = *hi;                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                                         \
            T x = p[i];                                                                              \
            mn = x < mn ? x : mn;                                                                    \
            mx = x > mx ? x : mx;                                                                    \
        }                                                                                            \
        *lo = mn, *hi = mx;                                                                          \
    }
#define MINMAX(T, W, TMIN, TMAX)                                                                     \
    MINMAXRUN(T)                                                                                     \
    static void minmax_##T(const Arr *a, Py_ssize_t rows, Py_ssize_t cols, W *lo, W *hi) {           \
        T mn = TMAX, mx = TMIN;                                                                      \
        if (a->rstride == cols * (Py_ssize_t)sizeof(T))                                              \
            minmaxrun_##T((const T *)row_at(a, 0), rows * cols, &mn, &mx);                           \
        else                                                                                         \
            for (Py_ssize_t r = 0; r < rows; r++) minmaxrun_##T((const T *)row_at(a, r), cols, &mn, &mx); \
        *lo = (W)mn;                                                                                 \
        *hi = (W)mx;                                                                                 \
    }
#define MINMAX_SIGNED(T, TMIN, TMAX) MINMAX(T, int64_t, TMIN, TMAX)
#define MINMAX_UNSIGNED(T, TMAX) MINMAX(T, uint64_t, 0, TMAX)
/* max of n contiguous elements: 128 bytes of independent accumulators, so the vector maxes pipeline. */
#define MAXRUN(T)                                                                                    \
    GB_CLONES static T maxrun_##T(const T *p, Py_ssize_t n, T mx) {                                  \
        enum { N = 128 / sizeof(T) };                                                                \
        T acc[N];                                                                                    \
        for (int k = 0; k < N; k++) acc[k] = mx;                                                     \
        Py_ssize_t i = 0;                                                                            \
        for (; i + N <= n; i += N)                                                                   \
            for (int k = 0; k < N; k++) acc[k] = p[i + k] > acc[k] ? p[i + k] : acc[k];              \
        for (; i < n; i++) mx = p[i] > mx ? p[i] : mx;                                               \
        for (int k = 0; k < N; k++) mx = acc[k] > mx ? acc[k] : mx;                                  \
        return mx;                                                                                   \
    }
#define MAXONLY(T)                                                                                   \
    MAXRUN(T)                                                                                        \
    static uint64_t max_##T(const Arr *a, Py_ssize_t rows, Py_ssize_t cols) {                        \
        if (a->rstride == cols * (Py_ssize_t)sizeof(T))                                              \
            return (uint64_t)maxrun_##T((const T *)row_at(a, 0), rows * cols, 0);                    \
        T mx = 0;                                                                                    \
        for (Py_ssize_t r = 0; r < rows; r++) mx = maxrun_##T((const T *)row_at(a, r), cols, mx);    \
        return (uint64_t)mx;                                                                         \
    }
MAXONLY(uint8_t)
MAXONLY(uint16_t)
MAXONLY(uint32_t)
MAXONLY(uint64_t)
MINMAX_SIGNED(int8_t, INT8_MIN, INT8_MAX)
MINMAX_SIGNED(int16_t, INT16_MIN, INT16_MAX)
MINMAX_SIGNED(int32_t, INT32_MIN, INT32_MAX)
MINMAX_SIGNED(int64_t, INT64_MIN, INT64_MAX)
MINMAX_UNSIGNED(uint8_t, UINT8_MAX)
MINMAX_UNSIGNED(uint16_t, UINT16_MAX)
MINMAX_UNSIGNED(uint32_t, UINT32_MAX)
MINMAX_UNSIGNED(uint64_t, UINT64_MAX)

/* A bound: 0 none, 1 a value in *v, 2 beyond int64 above, -2 beyond int64 below; -1 error/not an int. */
static int bound_of(PyObject *o, int64_t *v) {
    if (o == Py_None) return 0;
    if (!PyLong_CheckExact(o) && !PyLong_Check(o)) return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0) return 2;
    if (overflow < 0) return -2;
    *v = (int64_t)x;
    return 1;
}

/* lo and hi as bound_of reads them (kinds lk, hk). */
typedef struct {
    int lk, hk;
    int64_t lo, hi;
} Bounds;

/* 1: both read; 0: one is not an int (the caller says "cannot say"); -1: a Python error is set. */
static int bounds_of(PyObject *lo, PyObject *hi, Bounds *b) {
    b->lo = b->hi = 0;
    b->lk = bound_of(lo, &b->lo);
    b->hk = bound_of(hi, &b->hi);
    if (b->lk == -1 || b->hk == -1) return PyErr_Occurred() ? -1 : 0;
    return 1;
}

/* 1: region within bounds, 0: not, -1: cannot say (kind). */
static int region_fits(const Arr *a, Py_ssize_t rows, Py_ssize_t cols, const Bounds *b) {
    int lk = b->lk, hk = b->hk;
    int64_t lo = b->lo, hi = b->hi;
    if (rows == 0 || cols == 0) return 1;
    int integral = a->kind == K_SIGNED || a->kind == K_UNSIGNED;
    /* One reduction when only a maximum matters: unsigned with no positive lo, or signed with lo 0 and hi
     * within the type (viewed unsigned, a negative value then lies above hi). */
    int64_t smax = a->isz >= 8 ? INT64_MAX : ((int64_t)1 << (a->isz * 8 - 1)) - 1;
    int one = a->kind == K_UNSIGNED ? lk != 2 && (lk != 1 || lo <= 0) : lk == 1 && lo == 0 && hi <= smax;
    if (integral && hk == 1 && hi >= 0 && one) {
        uint64_t mx;
        switch (a->isz) {
        case 1: mx = max_uint8_t(a, rows, cols); break;
        case 2: mx = max_uint16_t(a, rows, cols); break;
        case 4: mx = max_uint32_t(a, rows, cols); break;
        case 8: mx = max_uint64_t(a, rows, cols); break;
        default: return -1;
        }
        return mx <= (uint64_t)hi;
    }
    if (a->kind == K_SIGNED) {
        int64_t mn, mx;
        switch (a->isz) {
        case 1: minmax_int8_t(a, rows, cols, &mn, &mx); break;
        case 2: minmax_int16_t(a, rows, cols, &mn, &mx); break;
        case 4: minmax_int32_t(a, rows, cols, &mn, &mx); break;
        case 8: minmax_int64_t(a, rows, cols, &mn, &mx); break;
        default: return -1;
        }
        if (lk == 2 || (lk == 1 && mn < lo)) return 0;
        if (hk == -2 || (hk == 1 && mx > hi)) return 0;
        return 1;
    }
    if (a->kind == K_UNSIGNED || a->kind == K_BOOL) {
        uint64_t mn, mx;
        switch (a->isz) {
        case 1: minmax_uint8_t(a, rows, cols, &mn, &mx); break;
        case 2: minmax_uint16_t(a, rows, cols, &mn, &mx); break;
        case 4: minmax_uint32_t(a, rows, cols, &mn, &mx); break;
        case 8: minmax_uint64_t(a, rows, cols, &mn, &mx); break;
        default: return -1;
        }
        if (a->kind == K_BOOL && mx > 1) return -1; /* not a real bool array: let numpy judge */
        if (lk == 2 || (lk == 1 && lo > 0 && mn < (uint64_t)lo)) return 0;
        if (hk == -2 || (hk == 1 && (hi < 0 || mx > (uint64_t)hi))) return 0;
        return 1;
    }
    return -1;
}

static int as_ssize(PyObject *o, Py_ssize_t *out, const char *what) {
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %zd", what, v);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *gb_fit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fit(arr, rows, width, lo, hi) takes 5 arguments");
        return NULL;
    }
    Py_ssize_t rows, width;
    if (as_ssize(args[1], &rows, "rows") < 0 || as_ssize(args[2], &width, "width") < 0) return NULL;
    Bounds b;
    int got = bounds_of(args[3], args[4], &b);
    if (got <= 0) {
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    Arr a;
    if (arr_get(args[0], &a, 0) < 0) return NULL;
    Py_ssize_t cols = a.ndim == 2 ? width : 1;
    if (rows > a.nrows || (a.ndim == 2 && width > a.ncols)) {
        arr_release(&a);
        PyErr_Format(PyExc_ValueError, "fit: region %zd x %zd outside the array's %zd x %zd", rows, cols,
                     a.nrows, a.ncols);
        return NULL;
    }
    int r = a.kind == K_NONE || a.kind == K_FLOAT || !a.aligned ? -1 : region_fits(&a, rows, cols, &b);
    arr_release(&a);
    if (r < 0) Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

/* accept(arr, ndim, cap_rows, cap_cols, lo, hi) -> (rows, width) | None
 * The whole of an integer or bool source, in one call: ndim as given, rows with contiguous elements, aligned,
 * at most cap_rows rows (and cap_cols columns when 2-D), every value within lo..hi. None for anything else,
 * errors included: the caller's general path then accepts it, clips it or names what is wrong. */
/* accept's test of one source: 1 and (*rows, *width) when accepted, 0 when not (errors cleared), -1 on error. */
static int accept_one(PyObject *arr, Py_ssize_t ndim, Py_ssize_t cap_rows, Py_ssize_t cap_cols, PyObject *lo,
                      PyObject *hi, Py_ssize_t *rows, Py_ssize_t *width) {
    Bounds b;
    int got = bounds_of(lo, hi, &b);
    if (got <= 0) return got;
    Arr a;
    if (arr_get(arr, &a, 0) < 0) {
        PyErr_Clear(); /* not a buffer: the general path says what it is */
        return 0;
    }
    Py_ssize_t cols = a.ndim == 2 ? a.ncols : 1;
    int ok = a.ndim == ndim && (ndim == 1 || ndim == 2) && a.aligned &&
             (a.kind == K_SIGNED || a.kind == K_UNSIGNED || a.kind == K_BOOL) && a.nrows <= cap_rows &&
             (ndim == 1 || a.ncols <= cap_cols);
    if (ok) ok = region_fits(&a, a.nrows, cols, &b) == 1;
    *rows = a.nrows, *width = ndim == 2 ? a.ncols : 0;
    arr_release(&a);
    return ok;
}

static PyObject *gb_accept(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "accept(arr, ndim, cap_rows, cap_cols, lo, hi) takes 6 arguments");
        return NULL;
    }
    Py_ssize_t ndim, cap_rows, cap_cols, rows, width;
    if (as_ssize(args[1], &ndim, "ndim") < 0 || as_ssize(args[2], &cap_rows, "cap_rows") < 0 ||
        as_ssize(args[3], &cap_cols, "cap_cols") < 0)
        return NULL;
    int ok = accept_one(args[0], ndim, cap_rows, cap_cols, args[4], args[5], &rows, &width);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", rows, width);
}

static PyObject *s_dtype, *s_fast, *s_capacity, *s_ndim, *s_lo, *s_hi, *s_rows_of_requests;

/* An attribute as a Py_ssize_t (the slot's ints); -1 with an error set on failure. */
static int attr_ssize(PyObject *o, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* One source of accept_all: 1 and *out (a new Prepared) when accepted; 0 when the general path decides. */
static int accept_item(PyObject *name, PyObject *src, PyObject *slots, PyObject *size, Py_ssize_t n,
                       PyTypeObject *prepared, PyObject **out) {
    PyObject *slot = PyDict_GetItemWithError(slots, name); /* borrowed */
    if (!slot) return PyErr_Occurred() ? -1 : 0;
    PyObject *dtype = NULL, *fast = NULL, *capacity = NULL, *lo = NULL, *hi = NULL, *table = NULL;
    int result = -1;
    Py_ssize_t ndim, cap_rows, cap_cols, rows, width;
    if (!(dtype = PyObject_GetAttr(src, s_dtype)) || !(fast = PyObject_GetAttr(slot, s_fast))) goto done;
    int in = PySequence_Contains(fast, dtype); /* dtypes cast safely without a value check */
    if (in <= 0) {
        result = in;
        goto done;
    }
    if (!(capacity = PyObject_GetAttr(slot, s_capacity))) goto done;
    PyObject *cap = PyDict_Check(capacity) ? PyDict_GetItemWithError(capacity, size) : NULL;
    if (!cap || !PyTuple_Check(cap) || PyTuple_GET_SIZE(cap) != 2) {
        result = PyErr_Occurred() ? -1 : 0; /* not a capture size: the general path */
        goto done;
    }
    cap_rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(cap, 0));
    cap_cols = PyLong_AsSsize_t(PyTuple_GET_ITEM(cap, 1));
    if (PyErr_Occurred() || attr_ssize(slot, s_ndim, &ndim) < 0) goto done;
    if (!(lo = PyObject_GetAttr(slot, s_lo)) || !(hi = PyObject_GetAttr(slot, s_hi))) goto done;
    int ok = accept_one(src, ndim, cap_rows, cap_cols, lo, hi, &rows, &width);
    if (ok <= 0) {
        result = ok;
        goto done;
    }
    if (n >= 0) { /* the rows must stand for n requests (the general path names a disagreement) */
        if (!(table = PyObject_GetAttr(slot, s_rows_of_requests))) goto done;
        if (table != Py_None) {
            if (!PyTuple_Check(table) || n >= PyTuple_GET_SIZE(table)) {
                result = 0;
                goto done;
            }
            Py_ssize_t want = PyLong_AsSsize_t(PyTuple_GET_ITEM(table, n));
            if (want == -1 && PyErr_Occurred()) goto done;
            if (want != rows) {
                result = 0;
                goto done;
            }
        }
    }
    PyObject *rv = PyLong_FromSsize_t(rows), *wv = PyLong_FromSsize_t(width);
    PyObject *p = rv && wv ? prepared->tp_alloc(prepared, 5) : NULL;
    if (!p) {
        Py_XDECREF(rv);
        Py_XDECREF(wv);
        goto done;
    }
    PyTuple_SET_ITEM(p, 0, Py_NewRef(slot));
    PyTuple_SET_ITEM(p, 1, Py_NewRef(src));
    PyTuple_SET_ITEM(p, 2, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(p, 3, rv);
    PyTuple_SET_ITEM(p, 4, wv);
    *out = p;
    result = 1;
done:
    Py_XDECREF(dtype);
    Py_XDECREF(fast);
    Py_XDECREF(capacity);
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    Py_XDECREF(table);
    return result;
}

/* accept_all(sources, slots, size, n, prepared, ndarray) -> [Prepared] | None
 * check_source's native path for every source of a mapping in one call: each an exact numpy array whose
 * dtype its slot casts safely (slot.fast), accepted whole by accept at capture size `size`, its rows those
 * of n live requests (n None: not checked). A list of Prepared (slot, host, None, rows, width) in the
 * mapping's order; None when any source needs the general path (which then accepts it or names what is
 * wrong). Reads the sources' memory only. */
static PyObject *gb_accept_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyDict_CheckExact(args[0]) || !PyDict_Check(args[1]) || !PyType_Check(args[4]) ||
        !PyType_IsSubtype((PyTypeObject *)args[4], &PyTuple_Type) || !PyType_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "accept_all(sources: dict, slots: dict, size, n, prepared: tuple type, ndarray: type)");
        return NULL;
    }
    PyObject *sources = args[0], *slots = args[1], *size = args[2];
    Py_ssize_t n = -1;
    if (args[3] != Py_None && as_ssize(args[3], &n, "n") < 0) return NULL;
    PyTypeObject *prepared = (PyTypeObject *)args[4], *ndarray = (PyTypeObject *)args[5];
    PyObject *out = PyList_New(PyDict_GET_SIZE(sources));
    if (!out) return NULL;
    Py_ssize_t pos = 0, i = 0;
    PyObject *name, *src;
    while (PyDict_Next(sources, &pos, &name, &src)) {
        PyObject *p = NULL;
        int ok = Py_TYPE(src) == ndarray ? accept_item(name, src, slots, size, n, prepared, &p) : 0;
        if (ok <= 0) {
            Py_DECREF(out);
            if (ok < 0) return NULL;
            Py_RETURN_NONE;
        }
        PyList_SET_ITEM(out, i++, p);
    }
    return out;
}

/* -------------------------------------------------------------------------------------------- write */

/* A write whose copies total more than this streams them past the cache: source and destination together
 * would not fit a 32 MiB last-level cache, so cached stores would evict the sources the check just read
 * and pay a read for every destination line. (Measured on a 32 MiB-L3 EPYC: 8 MiB copies are 17% faster
 * cached, 16 MiB ones 14% faster streamed. sysconf's L3 size is not used: in a VM it reports the host's.) */
static const Py_ssize_t stream_min = (Py_ssize_t)16 << 20;

#ifdef GB_STREAM
static void copy_stream(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t k = n / 64;
    for (size_t i = 0; i < k; i++, d += 64, s += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)s), x1 = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + 32)), x3 = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, x0);
        _mm_stream_si128((__m128i *)(d + 16), x1);
        _mm_stream_si128((__m128i *)(d + 32), x2);
        _mm_stream_si128((__m128i *)(d + 48), x3);
    }
    memcpy(d, s, n - k * 64);
}
#endif

/* Fill count elements of isz bytes at d with the pad pattern. */
static void fill(char *d, Py_ssize_t count, const char *pad, Py_ssize_t isz, int zero) {
    if (count <= 0) return;
    if (zero) {
        memset(d, 0, (size_t)(count * isz));
        return;
    }
    switch (isz) {
    case 1: memset(d, pad[0], (size_t)count); return;
    case 2: { uint16_t v; memcpy(&v, pad, 2); uint16_t *p = (uint16_t *)d; for (Py_ssize_t i = 0; i < count; i++) p[i] = v; return; }
    case 4: { uint32_t v; memcpy(&v, pad, 4); uint32_t *p = (uint32_t *)d; for (Py_ssize_t i = 0; i < count; i++) p[i] = v; return; }
    case 8: { uint64_t v; memcpy(&v, pad, 8); uint64_t *p = (uint64_t *)d; for (Py_ssize_t i = 0; i < count; i++) p[i] = v; return; }
    default:
        for (Py_ssize_t i = 0; i < count; i++) memcpy(d + i * isz, pad, (size_t)isz);
    }
}

/* Rows [r0, r1) × columns [0, c) of target t to the pad. */
static void fill_rows(const Arr *t, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t c, const char *pad, int zero) {
    if (r1 <= r0 || c <= 0) return;
    if (c == t->ncols && t->rstride == t->ncols * t->isz) {
        fill(row_at(t, r0), (r1 - r0) * c, pad, t->isz, zero);
        return;
    }
    for (Py_ssize_t r = r0; r < r1; r++) fill(row_at(t, r), c, pad, t->isz, zero);
}

/* Integer widening casts (safe casts only: see cast_of), one row of w elements. */
#define CONVERT_ROW(ST, DT)                                                                          \
    for (Py_ssize_t j = 0; j < w; j++) ((DT *)d)[j] = (DT)((const ST *)s)[j];
#define CONVERT_TO(DT)                                                                               \
    switch (src->kind == K_SIGNED ? (int)src->isz : -(int)src->isz) {                                \
    case 1: CONVERT_ROW(int8_t, DT) break;                                                           \
    case 2: CONVERT_ROW(int16_t, DT) break;                                                          \
    case 4: CONVERT_ROW(int32_t, DT) break;                                                          \
    case 8: CONVERT_ROW(int64_t, DT) break;                                                          \
    case -1: CONVERT_ROW(uint8_t, DT) break;                                                         \
    case -2: CONVERT_ROW(uint16_t, DT) break;                                                        \
    case -4: CONVERT_ROW(uint32_t, DT) break;                                                        \
    default: break;                                                                                  \
    }

static void convert_row(char *d, const Arr *dst, const char *s, const Arr *src, Py_ssize_t w) {
    switch (dst->kind == K_SIGNED ? (int)dst->isz : -(int)dst->isz) {
    case 2: CONVERT_TO(int16_t) break;
    case 4: CONVERT_TO(int32_t) break;
    case 8: CONVERT_TO(int64_t) break;
    case -2: CONVERT_TO(uint16_t) break;
    case -4: CONVERT_TO(uint32_t) break;
    case -8: CONVERT_TO(uint64_t) break;
    default: break;
    }
}

/* Can this kernel write src into dst? 1: bytes as they are, 2: integer widening, 0: no. */
static int cast_of(const Arr *src, const Arr *dst) {
    if (src->kind == K_NONE || dst->kind == K_NONE) return 0;
    if (src->isz == dst->isz) return src->kind == dst->kind; /* bool into bool copies bytes, as numpy does */
    /* numpy turns every nonzero bool byte into 1: a bool source into a number takes its path */
    if (src->isz > dst->isz || dst->kind == K_FLOAT || dst->kind == K_BOOL) return 0;
    if (src->kind != K_SIGNED && src->kind != K_UNSIGNED) return 0;
    if (src->isz == 8) return 0;
    if (dst->kind == K_UNSIGNED && src->kind == K_SIGNED) return 0; /* not a safe cast */
    if (dst->kind == K_SIGNED && src->kind != K_SIGNED && src->isz * 2 > dst->isz) return 0;
    return 2;
}

/* Rows [0, n) × columns [0, w) of src into t; streamed past the cache when large. A 1-D buffer is one row
 * of w elements (n = 1). */
static void copy_live(const Arr *t, const Arr *src, int cast, Py_ssize_t n, Py_ssize_t w, int stream) {
    if (n == 0 || w == 0) return;
    size_t row = (size_t)(w * t->isz);
    if (cast == 2) {
        for (Py_ssize_t r = 0; r < n; r++) convert_row(row_at(t, r), t, row_at(src, r), src, w);
        return;
    }
    int whole = t->rstride == (Py_ssize_t)row && (n == 1 || src->rstride == (Py_ssize_t)row);
#ifdef GB_STREAM
    if (stream) {
        if (whole) copy_stream(row_at(t, 0), row_at(src, 0), row * (size_t)n);
        else for (Py_ssize_t r = 0; r < n; r++) copy_stream(row_at(t, r), row_at(src, r), row);
        _mm_sfence();
        return;
    }
#endif
    if (whole) {
        memcpy(row_at(t, 0), row_at(src, 0), row * (size_t)n);
        return;
    }
    for (Py_ssize_t r = 0; r < n; r++) memcpy(row_at(t, r), row_at(src, r), row);
}

/* Do rows [0, n) × columns [0, w) of src share a byte with the whole of target t? */
static int overlaps(const Arr *src, Py_ssize_t n, Py_ssize_t w, const Arr *t) {
    if (n == 0 || w == 0) return 0;
    const char *s0 = row_at(src, 0), *s1 = row_at(src, n - 1);
    const char *lo = s0 < s1 ? s0 : s1, *hi = (s0 < s1 ? s1 : s0) + w * src->isz;
    const char *t0 = row_at(t, 0), *t1 = t0 + t->nrows * t->rstride;
    return lo < t1 && t0 < hi;
}

typedef struct {
    Arr t, src;
    int has_src, cast, zero;
    Py_ssize_t idx, n, w, end, rows, cols;
    Py_ssize_t r, c; /* the rectangle this write touches, from the marks before it */
    const char *pad;
} Job;

/* (a, b, c, d) as a tuple of ints (Py_BuildValue parses its format on every call), or NULL with an error. */
static PyObject *ssize_tuple4(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, Py_ssize_t d) {
    PyObject *t = PyTuple_New(4);
    if (t == NULL) return NULL;
    Py_ssize_t v[4] = {a, b, c, d};
    for (int q = 0; q < 4; q++) {
        PyObject *x = PyLong_FromSsize_t(v[q]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, q, x);
    }
    return t;
}

/* The packed upload's view of a checked write (see write with words_of): *out becomes (moved, rects, words,
 * rest) with moved 0 (the caller sets it once written); -1 with an error. words_of has one entry per slot
 * (checked by the caller). */
static int split_jobs(const Job *jobs, Py_ssize_t m, PyObject *seq, PyObject *words_of, Py_ssize_t limit,
                      PyObject **out) {
    PyObject *rects = PyList_New(0), *rest = PyList_New(0), *zero = NULL, *count = NULL;
    Py_ssize_t words = 0;
    if (rects == NULL || rest == NULL) goto fail;
    for (Py_ssize_t k = 0; k < m; k++) {
        const Job *j = &jobs[k];
        PyObject *it = PyTuple_GET_ITEM(seq, k), *of = PyTuple_GET_ITEM(words_of, j->idx), *t;
        int dev = PyTuple_GET_ITEM(it, 2) != Py_None;
        Py_ssize_t v[3] = {0, 0, 0};
        int packs = of != Py_None && j->r && j->c;
        if (packs) {
            if (!PyTuple_Check(of) || PyTuple_GET_SIZE(of) != 3) {
                PyErr_SetString(PyExc_TypeError, "write: words_of holds (word start, words per element, row stride) or None");
                goto fail;
            }
            for (int q = 0; q < 3; q++)
                if (as_ssize(PyTuple_GET_ITEM(of, q), &v[q], "a words_of entry") < 0) goto fail;
            if (v[1] == 0) {
                PyErr_SetString(PyExc_ValueError, "write: words per element must be >= 1");
                goto fail;
            }
            packs = j->r <= limit / v[1] / j->c; /* r * c * per <= limit, without overflow */
        }
        if (packs) {
            t = ssize_tuple4(v[0], j->r, j->c * v[1], v[2]);
            if (t == NULL || PyList_Append(rects, t) < 0) {
                Py_XDECREF(t);
                goto fail;
            }
            Py_DECREF(t);
            words += j->r * j->c * v[1];
            if (!dev) continue;
        }
        t = Py_BuildValue("(Onnn)", it, j->end, packs ? (Py_ssize_t)0 : j->r, j->c);
        if (t == NULL || PyList_Append(rest, t) < 0) {
            Py_XDECREF(t);
            goto fail;
        }
        Py_DECREF(t);
    }
    if ((zero = PyLong_FromSsize_t(0)) == NULL || (count = PyLong_FromSsize_t(words)) == NULL ||
        (*out = PyTuple_New(4)) == NULL)
        goto fail;
    PyTuple_SET_ITEM(*out, 0, zero); /* steals each */
    PyTuple_SET_ITEM(*out, 1, rects);
    PyTuple_SET_ITEM(*out, 2, count);
    PyTuple_SET_ITEM(*out, 3, rest);
    return 0;
fail:
    Py_XDECREF(rects);
    Py_XDECREF(rest);
    Py_XDECREF(zero);
    Py_XDECREF(count);
    return -1;
}

static int get_index(PyObject *seq, Py_ssize_t i, Py_ssize_t *out, const char *what) {
    PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
    return as_ssize(o, out, what);
}

static PyObject *gb_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "write(targets, items, ends, pads, rows_of, cols_of) takes 6 arguments (8 with words_of, limit)");
        return NULL;
    }
    PyObject *targets = args[0], *items = args[1], *ends = args[2], *pads = args[3];
    PyObject *rows_of = args[4], *cols_of = args[5], *words_of = nargs == 8 ? args[6] : NULL;
    Py_ssize_t limit = 0;
    if (!PyList_Check(targets) || !PyList_Check(rows_of) || !PyList_Check(cols_of) || !PyTuple_Check(ends) ||
        !PyTuple_Check(pads) || (words_of && !PyTuple_Check(words_of))) {
        PyErr_SetString(PyExc_TypeError, "write: targets, rows_of, cols_of must be lists; ends, pads, words_of tuples");
        return NULL;
    }
    if (words_of && as_ssize(args[7], &limit, "limit") < 0) return NULL;
    PyObject *seq = PySequence_Tuple(items); /* our own tuple: .index code cannot free an item under us */
    if (seq == NULL) return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(seq), nslots = PyList_GET_SIZE(targets);
    if (PyTuple_GET_SIZE(ends) != nslots || PyTuple_GET_SIZE(pads) != nslots || PyList_GET_SIZE(rows_of) != nslots ||
        PyList_GET_SIZE(cols_of) != nslots || (words_of && PyTuple_GET_SIZE(words_of) != nslots)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "write: targets, ends, pads, rows_of, cols_of, words_of differ in length");
        return NULL;
    }
    Job stack[16];
    Job *jobs = m <= 16 ? stack : PyMem_Calloc((size_t)m, sizeof(Job));
    if (jobs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    if (jobs == stack) memset(stack, 0, sizeof(stack)); /* every Arr starts not held */
    PyObject *result = NULL, *split = NULL;
    static PyObject *index_name = NULL;
    if (index_name == NULL && (index_name = PyUnicode_InternFromString("index")) == NULL) goto done;
    /* Phase 1: resolve and check every item; nothing is written unless all are good. */
    for (Py_ssize_t k = 0; k < m; k++) {
        Job *j = &jobs[k];
        PyObject *it = PyTuple_GET_ITEM(seq, k); /* seq is our own tuple: it stays alive */
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 5) {
            PyErr_SetString(PyExc_TypeError, "write: each item is a (slot, host, device, n, w) tuple");
            goto done;
        }
        PyObject *ix = PyObject_GetAttr(PyTuple_GET_ITEM(it, 0), index_name);
        if (ix == NULL) goto done;
        Py_ssize_t idx = PyLong_AsSsize_t(ix);
        Py_DECREF(ix);
        if (idx == -1 && PyErr_Occurred()) goto done;
        /* .index may have run Python code: the lists must still be the size checked above */
        if (PyList_GET_SIZE(targets) != nslots || PyList_GET_SIZE(rows_of) != nslots || PyList_GET_SIZE(cols_of) != nslots) {
            PyErr_SetString(PyExc_RuntimeError, "write: targets, rows_of or cols_of changed size during the call");
            goto done;
        }
        if (idx < 0 || idx >= nslots) {
            PyErr_Format(PyExc_IndexError, "write: slot index %zd outside 0..%zd", idx, nslots - 1);
            goto done;
        }
        for (Py_ssize_t q = 0; q < k; q++) {
            if (jobs[q].idx == idx) { /* marks are read before any write: one item per buffer */
                PyErr_Format(PyExc_ValueError, "write: slot index %zd given twice", idx);
                goto done;
            }
        }
        j->idx = idx;
        if (as_ssize(PyTuple_GET_ITEM(it, 3), &j->n, "n") < 0 || as_ssize(PyTuple_GET_ITEM(it, 4), &j->w, "w") < 0 ||
            as_ssize(PyTuple_GET_ITEM(ends, idx), &j->end, "end") < 0 ||
            get_index(rows_of, idx, &j->rows, "rows mark") < 0 || get_index(cols_of, idx, &j->cols, "cols mark") < 0)
            goto done;
        PyObject *pad = PyTuple_GET_ITEM(pads, idx);
        if (!PyBytes_Check(pad)) {
            PyErr_SetString(PyExc_TypeError, "write: pads are bytes");
            goto done;
        }
        if (arr_get(PyList_GET_ITEM(targets, idx), &j->t, 1) < 0) goto done;
        if (!j->t.aligned && j->t.kind != K_NONE) { /* the numpy path writes a misaligned target */
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        if (j->t.kind == K_NONE || j->t.rstride != j->t.ncols * j->t.isz || PyBytes_GET_SIZE(pad) != j->t.isz) {
            PyErr_SetString(PyExc_ValueError, "write: a target is not a C-contiguous buffer of its pad's width");
            goto done;
        }
        j->pad = PyBytes_AS_STRING(pad);
        j->zero = 1;
        for (Py_ssize_t b = 0; b < j->t.isz; b++) j->zero &= j->pad[b] == 0;
        Py_ssize_t w = j->t.ndim == 2 ? j->w : 1;
        Py_ssize_t c = j->t.ndim == 2 ? (j->w > j->cols ? j->w : j->cols) : 1;
        Py_ssize_t top = j->n > j->rows ? j->n : j->rows;
        if (j->n && j->end > top) top = j->end;
        if (top > j->t.nrows || c > j->t.ncols) {
            PyErr_Format(PyExc_ValueError, "write: rows %zd x cols %zd outside the target's %zd x %zd", top, c,
                         j->t.nrows, j->t.ncols);
            goto done;
        }
        j->r = top;
        j->c = c;
        PyObject *host = PyTuple_GET_ITEM(it, 1);
        j->has_src = host != Py_None;
        j->cast = 1;
        if (j->has_src) {
            if (arr_get(host, &j->src, 0) < 0) goto done;
            if (j->src.ndim != j->t.ndim || j->n > j->src.nrows || (j->t.ndim == 2 && w > j->src.ncols)) {
                PyErr_SetString(PyExc_ValueError, "write: a source is smaller than its live region");
                goto done;
            }
            j->cast = cast_of(&j->src, &j->t);
            if (j->cast == 0 || !j->src.aligned) { /* the numpy path does this cast, or reads it unaligned */
                result = Py_None;
                Py_INCREF(result);
                goto done;
            }
        }
    }
    /* A source inside any buffer this write touches (a view of the slab) could be overwritten before it is
     * read: the numpy path copies such sources first, so what was checked is what is written. */
    for (Py_ssize_t k = 0; k < m; k++) {
        const Job *j = &jobs[k];
        if (!j->has_src) continue;
        for (Py_ssize_t q = 0; q < m; q++) {
            int hit = j->t.ndim == 2 ? overlaps(&j->src, j->n, j->w, &jobs[q].t) : overlaps(&j->src, 1, j->n, &jobs[q].t);
            if (hit) {
                result = Py_None;
                Py_INCREF(result);
                goto done;
            }
        }
    }
    /* The packed upload's rectangles, made before the first byte is written (an error leaves all as it was). */
    if (words_of && split_jobs(jobs, m, seq, words_of, limit, &split) < 0) goto done;
    /* Phase 2: write. */
    Py_ssize_t copied = 0, moved = 0;
    for (Py_ssize_t k = 0; k < m; k++)
        if (jobs[k].has_src && jobs[k].cast == 1) copied += jobs[k].n * (jobs[k].t.ndim == 2 ? jobs[k].w : 1) * jobs[k].t.isz;
    int stream = copied > stream_min;
    for (Py_ssize_t k = 0; k < m; k++) {
        Job *j = &jobs[k];
        const Arr *t = &j->t;
        Py_ssize_t n = j->n, end = j->end, rows = j->rows, top = n, newcols = 0;
        if (t->ndim == 1) {
            if (j->has_src) copy_live(t, &j->src, j->cast, 1, n, stream); /* one row of n elements */
            if (n && end > n) {
                for (Py_ssize_t r = n; r < end; r++) memcpy(row_at(t, r), row_at(t, n - 1), (size_t)t->isz);
                top = end;
            }
            if (rows > top) fill(row_at(t, top), rows - top, j->pad, t->isz, j->zero);
        } else {
            Py_ssize_t w = j->w, cols = j->cols, c = w > cols ? w : cols;
            if (j->has_src) copy_live(t, &j->src, j->cast, n, w, stream);
            if (c > w && n) {
                for (Py_ssize_t r = 0; r < n; r++) fill(row_at(t, r) + w * t->isz, c - w, j->pad, t->isz, j->zero);
            }
            if (n && end > n) {
                if (c) /* a zero-width buffer has no bytes to repeat, however many rows */
                    for (Py_ssize_t r = n; r < end; r++) memcpy(row_at(t, r), row_at(t, n - 1), (size_t)(c * t->isz));
                top = end;
            }
            if (rows > top) fill_rows(t, top, rows, c, j->pad, j->zero);
            newcols = top ? w : 0;
        }
        moved += j->r * j->c * t->isz;
        PyObject *a = PyLong_FromSsize_t(top), *b = PyLong_FromSsize_t(newcols);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto done;
        }
        /* steal a and b; replacing a mark may run a __del__ that shrinks a list: checked */
        if (PyList_SetItem(rows_of, j->idx, a) < 0) {
            Py_DECREF(b);
            goto done;
        }
        if (PyList_SetItem(cols_of, j->idx, b) < 0) goto done;
    }
    if (split == NULL) {
        result = PyLong_FromSsize_t(moved);
    } else { /* (moved, rects, words, rest): split, made before the write, with moved now known */
        PyObject *count = PyLong_FromSsize_t(moved);
        if (count == NULL) goto done;
        if (PyTuple_SetItem(split, 0, count) < 0) goto done; /* our own new tuple: steals count */
        result = split;
        split = NULL;
    }
done:
    for (Py_ssize_t k = 0; k < m; k++) {
        arr_release(&jobs[k].t);
        arr_release(&jobs[k].src);
    }
    if (jobs != stack) PyMem_Free(jobs);
    Py_XDECREF(split);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"fit", (PyCFunction)(void (*)(void))gb_fit, METH_FASTCALL, "Values of a region within lo..hi."},
    {"accept", (PyCFunction)(void (*)(void))gb_accept, METH_FASTCALL, "A whole source that needs no more checks."},
    {"write", (PyCFunction)(void (*)(void))gb_write, METH_FASTCALL, "The live-row write of a refresh."},
    {"accept_all", (PyCFunction)(void (*)(void))gb_accept_all, METH_FASTCALL, "Every source of a mapping at once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

int gb_staged_init(PyObject *mod); /* _staged.c: the staged writes' type and functions */

PyMODINIT_FUNC PyInit__native(void) {
    s_dtype = PyUnicode_InternFromString("dtype");
    s_fast = PyUnicode_InternFromString("fast");
    s_capacity = PyUnicode_InternFromString("capacity");
    s_ndim = PyUnicode_InternFromString("ndim");
    s_lo = PyUnicode_InternFromString("lo");
    s_hi = PyUnicode_InternFromString("hi");
    s_rows_of_requests = PyUnicode_InternFromString("rows_of_requests");
    if (!s_dtype || !s_fast || !s_capacity || !s_ndim || !s_lo || !s_hi || !s_rows_of_requests) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && (PyModule_AddIntConstant(mod, "STREAM_MIN", (long)stream_min) < 0 || gb_staged_init(mod) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
