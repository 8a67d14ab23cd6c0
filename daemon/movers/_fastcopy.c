/* kvswap.daemon.movers._fastcopy: copy a table of (src, dst, nbytes) rows with the GIL released,
 * surviving a fault in the middle of a row.
 *
 * Why: the daemon copies out of an engine's shared-memory segment through a mapping. The engine
 * may truncate the segment at any moment; a copy touching a page past the new end takes SIGBUS,
 * which would kill the daemon. The fallback (preadv/pwritev, segment.py) is crash-safe but costs
 * one Python call per chunk, each retaking the GIL. Here a whole batch is one call, with the GIL
 * released, and a fault inside it becomes a return value.
 *
 * How: a SIGBUS/SIGSEGV handler, installed at import and taken back before any batch if
 * something replaced it since. Each thread has its own jump buffer and
 * "in a guarded copy" flag (a synchronous fault is delivered to the thread that faulted, so
 * thread-local state is enough). A fault while the flag is set jumps back to copy_rows, which
 * reports the row. A fault anywhere else is not ours: the handler puts the previous disposition
 * back and lets the fault happen again, so real crashes stay crashes (and faulthandler, if it was
 * installed first, still prints its traceback).
 *
 * Stopping: a caller may pass a stop flag (a uint32 in memory it owns). The loop reads it before
 * every row and every STOP_CHECK_BYTES of a long row, and returns early once it is set. The
 * daemon sets it when a request's deadline passes and answers only after the copy has returned,
 * so no row of a batch starts after the engine was told it may reuse its blocks (a batch checked
 * only at its start ran on after the answer and stored torn KV that verified: issue 22).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* initial-exec: the handler must read these without a lazy TLS allocation (not signal-safe). */
static __thread sigjmp_buf fault_jump __attribute__((tls_model("initial-exec")));
static __thread volatile sig_atomic_t in_guarded_copy __attribute__((tls_model("initial-exec")));

static struct sigaction previous_bus, previous_segv;

static void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    if (in_guarded_copy) {
        in_guarded_copy = 0;
        /* SA_NODEFER left the signal unblocked, so jumping out needs no mask restore. */
        siglongjmp(fault_jump, 1);
    }
    /* Not our copy: hand the signal to whoever had it before us. */
    sigaction(sig, sig == SIGBUS ? &previous_bus : &previous_segv, NULL);
    /* A real fault re-executes the instruction and faults again into that handler. A signal sent
     * with kill()/raise() (si_code <= 0) would not come back by itself: send it again. */
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

/* Make on_fault the handler of `sig`, keeping whatever is there now as the one to chain to. A
 * handler that is already ours is left alone, so we never chain to ourselves. */
static int take_signal(int sig, struct sigaction *previous) {
    struct sigaction current;
    if (sigaction(sig, NULL, &current) != 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_fault)
        return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    sigemptyset(&action.sa_mask);
    /* SA_NODEFER: a fault is not blocked while we handle it (we longjmp out of the handler);
     * SA_ONSTACK: use an alternate stack if the thread set one (a stack overflow is still fatal). */
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    return sigaction(sig, &action, previous);
}

/* Called with the GIL held (at import and before every batch), so two threads never install at
 * once. Checked per batch, not only at import: a library loaded later (paddle installs its own
 * fatal-signal handlers; Python's signal.signal does too) replaces ours, and a guarded fault
 * would then reach a handler that aborts the process or returns into the same fault forever.
 * Taking the signal back costs two sigaction queries per batch. */
static int install_handler(void) {
    if (take_signal(SIGBUS, &previous_bus) != 0)
        return -1;
    if (take_signal(SIGSEGV, &previous_segv) != 0)
        return -1;
    return 0;
}

/* Rows at least this long are copied with non-temporal (cache-bypassing) stores where the CPU
 * has them. A row is a region's chunk of one block (tens to hundreds of KiB): glibc's memcpy
 * uses ordinary stores below its own, much larger threshold, which read every destination line
 * into the cache first. The bytes are not read again soon (they go to disk, or to an engine
 * block), so skipping that read made strided chunk copies about 1.2-1.4x faster on the test
 * machine (benchmarks/segment_copy.py). */
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES (16 * 1024)
#endif

/* A long row is copied in pieces of this size with the stop flag read between them, so a stop
 * waits for at most one piece (about 0.1 ms at memcpy speed), whatever the layout's row size. */
#ifndef STOP_CHECK_BYTES
#define STOP_CHECK_BYTES (1024 * 1024)
#endif

static void copy_piece(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES) {
        /* Align the destination to 16 bytes (streaming stores need it), then 64 bytes a step. */
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

static int stopped(const uint32_t *stop) {
    return stop != NULL && __atomic_load_n(stop, __ATOMIC_ACQUIRE) != 0;
}

/* Copy one row, in pieces; 0 if the stop flag was seen set before the row was whole. */
static int copy_row(char *dst, const char *src, size_t n, const uint32_t *stop) {
    while (n > STOP_CHECK_BYTES) {
        copy_piece(dst, src, STOP_CHECK_BYTES);
        dst += STOP_CHECK_BYTES, src += STOP_CHECK_BYTES, n -= STOP_CHECK_BYTES;
        if (stopped(stop))
            return 0;
    }
    copy_piece(dst, src, n);
    return 1;
}

/* copy_rows(table, stop=None) -> int: rows copied whole (fewer than the table's when the stop flag
 * was set), or -(row + 1) for the row whose copy faulted. */
static PyObject *copy_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *table_arg, *stop_arg = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:copy_rows", &table_arg, &stop_arg))
        return NULL;
    Py_buffer view, stop_view;
    const uint32_t *stop = NULL;
    if (PyObject_GetBuffer(table_arg, &view, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    if (view.len % (3 * sizeof(uint64_t)) != 0 || ((uintptr_t)view.buf % sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "table must be an aligned, C-contiguous buffer of uint64 rows "
                                          "(src, dst, nbytes)");
        return NULL;
    }
    if (stop_arg != Py_None) {
        if (PyObject_GetBuffer(stop_arg, &stop_view, PyBUF_C_CONTIGUOUS) != 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        if (stop_view.len < (Py_ssize_t)sizeof(uint32_t) || ((uintptr_t)stop_view.buf % sizeof(uint32_t)) != 0) {
            PyBuffer_Release(&stop_view);
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "stop must be an aligned buffer of at least one uint32");
            return NULL;
        }
        stop = (const uint32_t *)stop_view.buf;
    }
    if (install_handler() != 0) {
        if (stop != NULL)
            PyBuffer_Release(&stop_view);
        PyBuffer_Release(&view);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    const uint64_t *rows = (const uint64_t *)view.buf;
    const Py_ssize_t count = view.len / (Py_ssize_t)(3 * sizeof(uint64_t));
    /* volatile: read after siglongjmp, so it must live in memory, not in a clobbered register. */
    volatile Py_ssize_t row = 0;
    int faulted = 0;

    Py_BEGIN_ALLOW_THREADS
    /* savemask 0: no sigprocmask call per batch (SA_NODEFER means the mask never changes). */
    if (sigsetjmp(fault_jump, 0) == 0) {
        in_guarded_copy = 1;
        for (; row < count; row++) {
            const uint64_t *r = rows + 3 * row;
            if (stopped(stop) || !copy_row((char *)(uintptr_t)r[1], (const char *)(uintptr_t)r[0], (size_t)r[2], stop))
                break;
        }
#if defined(__SSE2__)
        _mm_sfence(); /* streamed stores are weakly ordered: visible to other threads before we return */
#endif
        in_guarded_copy = 0;
    } else {
        faulted = 1; /* the handler cleared in_guarded_copy before jumping */
    }
    Py_END_ALLOW_THREADS

    if (stop != NULL)
        PyBuffer_Release(&stop_view);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(faulted ? -(row + 1) : row);
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(table, stop=None) -> int\n\n"
     "Copy each row (src address, dst address, nbytes) of a C-contiguous uint64 table, in order, "
     "with the GIL released. `stop`, if given, is a buffer whose first uint32 is read before each "
     "row and each MiB of a row: once it is non-zero the copy returns. Returns the number of rows "
     "copied whole (fewer than the table's when stopped; the next row may be partly copied), or "
     "-(row + 1) when reading or writing row `row` faulted (SIGBUS/SIGSEGV); rows before it were "
     "copied, later ones were not. The caller owns every address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcopy", "Fault-guarded batch memcpy (see _fastcopy.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastcopy(void) {
    /* With the GIL held at import; copy_rows takes the signals back if someone replaces us. */
    if (install_handler() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *m = PyModule_Create(&module);
    /* 2: copy_rows takes a stop flag. native.py refuses a stale build without it. */
    if (m != NULL && PyModule_AddIntConstant(m, "API_VERSION", 2) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
