/* Page copies that store past the cache, for a reload's writes into vLLM's KV pages
 * (connector.kv_pages, PagedKVCache.write on CPU).
 *
 * A reload copies each object's pages (1.18 MB each for GLM-5.3-Flash's latent) into the KV
 * buffer once. glibc's memcpy stores past the cache (non-temporal stores) only for copies
 * above a threshold of hundreds of MiB by default, so page-sized copies go through the cache:
 * every destination line is read in before it is overwritten, and the engine's working set
 * is evicted on the way. Here a page is copied with SSE2 streaming stores, which every
 * x86-64 CPU has, four 4 KiB pages interleaved (four streams for the prefetchers, as glibc's
 * own large copy does), with one store fence at the end of a call. Measured on 2 cores of an
 * Intel Xeon: 2400 pages of 1.18 MB in a shuffled order at 12.1 GB/s, against 12.2 for one
 * glibc memmove of the same 2.8 GB and 6.9 for one-thread torch copies of the pages.
 *
 * copy_pages(table, streaming=True): ``table`` is a C-contiguous buffer of uint64 triples
 * (destination address, source address, bytes), one per copy, run with streaming stores, or
 * with memcpy where ``streaming`` is false (parts of rows: pieces of a few hundred bytes,
 * whose lines the next rows share); the GIL is released while they run. The addresses are
 * the caller's to vouch for (PagedKVCache computes them from its checked geometry).
 * STREAMING is 0 where the build has no streaming stores (not x86-64): every copy is then a
 * memcpy, still one call for a whole table without the GIL.
 *
 * copy_rows(table): each row of ``table`` (C-contiguous uint64 sextuples: destination, source,
 * bytes per piece, pieces, destination stride, source stride) copies that many pieces with
 * memcpy, each piece the strides further on both sides; the GIL is released meanwhile. A page
 * of parts of rows (a group that holds part of each row of its layer's page) is one row here
 * rather than one per piece: the table a load's batch builds is then hundreds of rows, not
 * hundreds of thousands, and building it holds the GIL that much less.
 *
 * buffer_spans(buffers): the (address, bytes) of each C-contiguous buffer of a sequence, as
 * uint64 pairs in one bytes object: a load's sources (hundreds of payloads) named in one call
 * rather than a numpy array made per payload, which held the GIL for microseconds each that
 * the model's thread in the same process waits for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1

static inline void copy_line(char *d, const char *s)
{
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}

static void copy_streaming(char *d, const char *s, size_t n)
{
    enum { LINE = 64, PAGE = 4096, WAYS = 4 };
    size_t head = (LINE - ((uintptr_t)d & (LINE - 1))) & (LINE - 1);  /* to a line boundary */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= WAYS * PAGE; d += WAYS * PAGE, s += WAYS * PAGE, n -= WAYS * PAGE) {
        /* the hardware prefetchers stop at 4 KiB pages: ask for the next block's lines */
        int ahead = n >= 2 * WAYS * PAGE;
        for (size_t off = 0; off < PAGE; off += LINE)
            for (int k = 0; k < WAYS; k++) {
                if (ahead)
                    _mm_prefetch(s + WAYS * PAGE + k * PAGE + off, _MM_HINT_T0);
                copy_line(d + k * PAGE + off, s + k * PAGE + off);
            }
    }
    for (; n >= LINE; d += LINE, s += LINE, n -= LINE)
        copy_line(d, s);
    memcpy(d, s, n);
}
#define COPY copy_streaming
#define FENCE() _mm_sfence()
#else
#define STREAMING 0
#define COPY memcpy
#define FENCE() ((void)0)
#endif

/* ``table``'s buffer, whole rows of ``columns`` uint64 each; -1 with an exception set when
 * it is not (``rows`` names them in the message). */
static int table_view(PyObject *table, Py_buffer *view, size_t columns, const char *rows)
{
    if (PyObject_GetBuffer(table, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % (Py_ssize_t)(columns * sizeof(uint64_t))) {
        PyErr_Format(PyExc_ValueError, "table of %zd bytes: not whole %s", view->len, rows);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_pages(PyObject *self, PyObject *args)
{
    PyObject *table;
    int streaming = 1;
    if (!PyArg_ParseTuple(args, "O|p:copy_pages", &table, &streaming))
        return NULL;
    Py_buffer view;
    if (table_view(table, &view, 3, "(destination, source, bytes) uint64 triples") < 0)
        return NULL;
    const char *row = view.buf;
    size_t count = (size_t)view.len / (3 * sizeof(uint64_t));
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < count; i++, row += 3 * sizeof(uint64_t)) {
        uint64_t e[3];
        memcpy(e, row, sizeof e);  /* the table's alignment is the caller's */
        if (streaming)
            COPY((char *)(uintptr_t)e[0], (const char *)(uintptr_t)e[1], (size_t)e[2]);
        else
            memcpy((char *)(uintptr_t)e[0], (const char *)(uintptr_t)e[1], (size_t)e[2]);
    }
    if (streaming)
        FENCE();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *copy_rows(PyObject *self, PyObject *table)
{
    Py_buffer view;
    if (table_view(table, &view, 6, "(destination, source, bytes, pieces, destination stride, source stride) "
                   "uint64 sextuples") < 0)
        return NULL;
    const char *row = view.buf;
    size_t count = (size_t)view.len / (6 * sizeof(uint64_t));
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < count; i++, row += 6 * sizeof(uint64_t)) {
        uint64_t e[6];
        memcpy(e, row, sizeof e);
        char *d = (char *)(uintptr_t)e[0];
        const char *s = (const char *)(uintptr_t)e[1];
        for (uint64_t k = 0; k < e[3]; k++, d += e[4], s += e[5])
            memcpy(d, s, (size_t)e[2]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *buffer_spans(PyObject *self, PyObject *buffers)
{
    PyObject *seq = PySequence_Fast(buffers, "buffer_spans takes a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 2 * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *row = PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++, row += 2 * sizeof(uint64_t)) {
        Py_buffer view;
        if (PyObject_GetBuffer(items[i], &view, PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        uint64_t e[2] = {view.len ? (uint64_t)(uintptr_t)view.buf : 0, (uint64_t)view.len};
        memcpy(row, e, sizeof e);
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(table, streaming=True): run each (destination, source, bytes) uint64 triple of a "
     "C-contiguous buffer as a copy, with streaming stores where asked and STREAMING, else memcpy; "
     "the GIL is released meanwhile."},
    {"copy_rows", copy_rows, METH_O,
     "copy_rows(table): each (destination, source, bytes, pieces, destination stride, source stride) uint64 "
     "sextuple of a C-contiguous buffer as that many memcpy pieces, the strides apart; the GIL is released "
     "meanwhile."},
    {"buffer_spans", buffer_spans, METH_O,
     "buffer_spans(buffers): the (address, bytes) of each C-contiguous buffer, as uint64 pairs in one "
     "bytes object (address 0 for an empty one)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Page copies that store past the cache (connector.kv_pages).", -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
