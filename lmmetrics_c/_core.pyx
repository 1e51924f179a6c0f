# cython: language_level=3, boundscheck=False, wraparound=False
"""Binding to the native core: turns checked Python arguments into one
lm_job and runs it with the GIL released. The Python package validates
everything first; here Cython checks the targets and outputs (through the
buffer protocol: 1-D, C-contiguous, int64 / float64, one value a row) and
holds them for the call. The logits arrive as (address, row stride, outer
stride): their owner is kept alive by the caller."""

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_SIMPLE, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset, strcmp

cdef extern from "lm_kernel.h" nogil:
    cpdef enum lm_status:
        LM_OK
        LM_ERR_NAN
        LM_ERR_NAN_REF
        LM_ERR_EMPTY
        LM_ERR_EMPTY_REF
        LM_ERR_ARGS
        LM_ERR_NOMEM
        LM_ERR_TARGET
        LM_INTERRUPTED

    ctypedef struct lm_buffer:
        const void *base
        int64_t row_stride
        int64_t outer_stride

    ctypedef struct lm_job:
        int dtype
        int64_t n_rows, n_cols, rows_inner
        lm_buffer logits
        lm_buffer ref
        const int64_t *targets
        int64_t ignore_index
        double softcap
        double *nll
        double *entropy
        int64_t *argmax
        double *kl
        int64_t *ref_argmax
        double *ref_nll
        int64_t *rank
        double *top_logprob
        double *nll_sum
        int64_t *n_counted
        int num_threads
        int (*interrupted)(void *arg) noexcept nogil
        void *interrupt_arg

    int lm_run(const lm_job *job, int64_t *bad_row)
    int lm_isa_supported(int isa)
    int lm_isa_active()
    int lm_isa_set(int isa)
    int lm_isa_best()
    const char *lm_isa_name(int isa)
    int lm_openmp()
    int lm_max_threads()
    void lm_init()

cdef extern from "lm_bench.h" nogil:
    uint64_t lm_read_pass(const void *p, int64_t nbytes, int num_threads, int isa, int prefetch)

cdef extern from *:
    """
    #ifndef LM_CFLAGS
    #define LM_CFLAGS "unknown"
    #endif
    #ifndef LM_ISAS_BUILT
    #define LM_ISAS_BUILT "scalar"
    #endif
    #ifndef LM_OPENMP_BUILD
    #define LM_OPENMP_BUILD "unknown"
    #endif
    """
    const char *LM_CFLAGS
    const char *LM_OPENMP_BUILD
    const char *LM_ISAS_BUILT

DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
ISAS = ("scalar", "avx2", "avx512", "neon")
CFLAGS = LM_CFLAGS.decode()
OPENMP_BUILD = LM_OPENMP_BUILD.decode()  # the OpenMP flags the build used, or "none"
ISAS_BUILT = tuple(LM_ISAS_BUILT.decode().split())

import threading

cdef unsigned long _MAIN_THREAD = threading.main_thread().ident
lm_init()


cdef int _signalled(void *arg) noexcept nogil:
    """Between chunks of a job run from the main thread: run Python's signal
    handlers; an exception they raise (KeyboardInterrupt) stops the job and
    is re-raised when it returns."""
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as e:
            (<list>arg).append(e)
            return 1
    return 0


# The per-row arrays of a job, in the order run holds them: the targets
# (read) and the outputs (written); which hold int64, the rest float64.
_ARRAYS = ("targets", "nll", "entropy", "argmax", "kl", "ref_argmax", "ref_nll", "rank", "top_logprob")
cdef int _N_ARRAYS = 9
cdef bint _INT64[9]
_INT64[:] = [True, False, False, True, False, True, False, True, False]


cdef inline bint _is_int64(const char *f) noexcept nogil:
    """a buffer format of native int64 (numpy writes "l" or "q"; a prefix
    for another byte order or alignment)"""
    return f != NULL and (strcmp(f, b"l") == 0 or strcmp(f, b"q") == 0)


cdef int _hold(object a, Py_buffer *view, int k, int64_t n_rows) except -1:
    """Acquire array k's buffer (a plain buffer request: a typed memoryview
    costs about 0.3 us more an array, which a one-row call sees): 1-D,
    C-contiguous, native int64 or float64 as _INT64 says (numpy gives an
    unaligned or byte-swapped array a format with a prefix, "=q"), at an
    address aligned to 8, writable for the outputs, n_rows values; else
    ValueError (BufferError for a read-only output) naming it. Checked in C
    before any Python object is made, so that nothing stands between a
    failed check and the release."""
    PyObject_GetBuffer(a, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (PyBUF_WRITABLE if k else 0))
    cdef const char *f = view.format
    cdef bint ok = (view.ndim == 1 and view.itemsize == 8 and f != NULL
                    and (<uintptr_t>view.buf) % 8 == 0
                    and (_is_int64(f) if _INT64[k] else strcmp(f, b"d") == 0))
    cdef Py_ssize_t got = view.shape[0] if view.ndim == 1 else -1
    if ok and got == n_rows:
        return 0
    PyBuffer_Release(view)
    if not ok:
        raise ValueError(f"lmmetrics: {_ARRAYS[k]} must be a 1-D C-contiguous aligned native "
                         f"{'int64' if _INT64[k] else 'float64'} array")
    raise ValueError(f"lmmetrics: {_ARRAYS[k]} holds {got} values for {n_rows} rows")


cdef void _check_buffer(str name, tuple b) except *:
    if len(b) != 3:
        raise ValueError(f"lmmetrics: {name} must be (address, row stride, outer stride), got {b!r}")


def run(*, int dtype, int64_t n_rows, int64_t n_cols, int64_t rows_inner, tuple logits,
        tuple reference=None, targets=None, int64_t ignore_index=-100, double softcap=0.0,
        tuple outputs=(), int num_threads=0):
    """Run one job; returns (status, first bad row, NLL sum, rows counted):
    status is an lm_status value (an int), the totals 0 unless targets (and nll) are given.
    ``logits`` and ``reference`` are (address, row_stride, outer_stride) in
    elements; the caller keeps their memory alive. ``outputs`` is
    (nll, entropy, argmax, kl, ref_argmax, ref_nll, rank, top_logprob), each
    an array or None (missing ones None); targets and outputs hold n_rows
    int64 / float64 values (see _ARRAYS). One tuple, not eight keywords: past a dozen
    keywords a call costs about 0.6 us more. A KeyboardInterrupt (or
    another exception from a signal handler) during a call from the main
    thread stops it within milliseconds and is raised here."""
    cdef lm_job job
    cdef int64_t bad = -1, n_counted = 0
    cdef double nll_sum = 0.0
    cdef int status, k, held = 0
    cdef Py_buffer views[9]
    cdef void *ptrs[9]
    cdef list raised = []
    cdef Py_ssize_t n_out = len(outputs)
    _check_buffer("logits", logits)
    if reference is not None:
        _check_buffer("reference", reference)
    if n_out > _N_ARRAYS - 1:
        raise ValueError(f"lmmetrics: outputs holds {n_out} arrays, at most {_N_ARRAYS - 1}")
    try:
        for k in range(_N_ARRAYS):
            ptrs[k] = NULL
            a = targets if k == 0 else outputs[k - 1] if k <= n_out else None
            if a is not None:
                _hold(a, &views[k], k, n_rows)
                held |= 1 << k
                if n_rows:
                    ptrs[k] = views[k].buf
        job.dtype = dtype
        job.n_rows = n_rows
        job.n_cols = n_cols
        job.rows_inner = rows_inner
        job.logits.base = <const void *><uintptr_t>logits[0]
        job.logits.row_stride = logits[1]
        job.logits.outer_stride = logits[2]
        if reference is None:
            job.ref.base = NULL
            job.ref.row_stride = job.ref.outer_stride = 0
        else:
            job.ref.base = <const void *><uintptr_t>reference[0]
            job.ref.row_stride = reference[1]
            job.ref.outer_stride = reference[2]
        job.targets = <const int64_t *>ptrs[0]
        job.ignore_index = ignore_index
        job.softcap = softcap
        job.nll = <double *>ptrs[1]
        job.entropy = <double *>ptrs[2]
        job.argmax = <int64_t *>ptrs[3]
        job.kl = <double *>ptrs[4]
        job.ref_argmax = <int64_t *>ptrs[5]
        job.ref_nll = <double *>ptrs[6]
        job.rank = <int64_t *>ptrs[7]
        job.top_logprob = <double *>ptrs[8]
        job.nll_sum = &nll_sum if job.nll != NULL and job.targets != NULL else NULL
        job.n_counted = &n_counted if job.targets != NULL else NULL
        job.num_threads = num_threads
        status = _execute(&job, &bad, raised)
    finally:
        for k in range(_N_ARRAYS):
            if held & (1 << k):
                PyBuffer_Release(&views[k])
    if raised:
        raise raised[0]
    return status, bad, nll_sum, n_counted


cdef int _execute(lm_job *job, int64_t *bad, list raised) noexcept:
    """lm_run with the GIL released; from the main thread, Python's signal
    handlers run between chunks and what they raise goes to raised."""
    cdef int status
    job.interrupted = NULL
    job.interrupt_arg = <void *>raised
    if PyThread_get_thread_ident() == _MAIN_THREAD:
        job.interrupted = _signalled
    with nogil:
        status = lm_run(job, bad)
    return status


# the buffer formats of the plain call's logits, by dtype code (native
# byte order: numpy writes a prefix otherwise)
cdef const char *_PLAIN_FORMATS[3]
_PLAIN_FORMATS[:] = [b"f", b"d", b"e"]


def nll_total(object logits, object targets, int64_t ignore_index, int num_threads):
    """(NLL sum, rows counted) of the plain call, or None for any other:
    logits a C-contiguous aligned float32 / float64 / float16 buffer of
    native byte order with at least one row and one column, targets a
    C-contiguous aligned native int64 buffer of the logits' shape without
    the vocabulary axis. The job is the one ``run`` gets from the package's
    description of such arrays (the same bits); the per-row NLL lives in a
    scratch buffer. None too when the core reports a bad row or target: the
    caller then takes the general path, which names it."""
    cdef Py_buffer lv, tv
    cdef lm_job job
    cdef int64_t bad = -1, n_counted = 0, n_rows = 1
    cdef double nll_sum = 0.0
    cdef double *nll = NULL
    cdef int status = -1, dtype = -1, k
    cdef list raised = []
    try:
        PyObject_GetBuffer(logits, &lv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, ValueError, TypeError):  # not C-contiguous, or no buffer
        return None
    try:
        if lv.ndim < 1 or lv.format == NULL or (<uintptr_t>lv.buf) % lv.itemsize:
            return None
        for k in range(3):
            if strcmp(lv.format, _PLAIN_FORMATS[k]) == 0:
                dtype = k
        if dtype < 0 or lv.shape[lv.ndim - 1] < 1:
            return None
        for k in range(lv.ndim - 1):
            n_rows *= lv.shape[k]
        if n_rows < 1:
            return None
        try:
            PyObject_GetBuffer(targets, &tv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        except (BufferError, ValueError, TypeError):
            return None
        try:
            if (tv.ndim != lv.ndim - 1 or tv.itemsize != 8 or (<uintptr_t>tv.buf) % 8
                    or not _is_int64(tv.format)):
                return None
            for k in range(tv.ndim):
                if tv.shape[k] != lv.shape[k]:
                    return None
            nll = <double *>malloc(<size_t>n_rows * sizeof(double))
            if nll == NULL:
                return None
            memset(&job, 0, sizeof(job))
            job.dtype = dtype
            job.n_rows = n_rows
            job.n_cols = lv.shape[lv.ndim - 1]
            job.rows_inner = n_rows
            job.logits.base = lv.buf
            job.logits.row_stride = job.n_cols if n_rows > 1 else 0
            job.targets = <const int64_t *>tv.buf
            job.ignore_index = ignore_index
            job.nll = nll
            job.nll_sum = &nll_sum
            job.n_counted = &n_counted
            job.num_threads = num_threads
            status = _execute(&job, &bad, raised)
        finally:
            free(nll)
            PyBuffer_Release(&tv)
    finally:
        PyBuffer_Release(&lv)
    if raised:
        raise raised[0]
    return (nll_sum, n_counted) if status == LM_OK else None


def address(obj):
    """The address of the first byte of a C-contiguous buffer (the buffer
    protocol; a faster __array_interface__["data"][0]). The caller keeps obj
    alive while the address is used."""
    cdef Py_buffer view
    cdef uintptr_t p
    PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)
    p = <uintptr_t>view.buf
    PyBuffer_Release(&view)
    return p


def isa_supported(str name):
    return name in ISAS and lm_isa_supported(ISAS.index(name)) == 1


def set_isa(str name):
    if not isa_supported(name):
        raise ValueError(f"ISA {name!r} is not available on this machine or build "
                         f"(available: {[i for i in ISAS if isa_supported(i)]})")
    lm_isa_set(ISAS.index(name))


def active_isa():
    return lm_isa_name(lm_isa_active()).decode()


def best_isa():
    return lm_isa_name(lm_isa_best()).decode()


def openmp():
    return lm_openmp() == 1


def max_threads():
    return lm_max_threads()


def read_pass(uintptr_t ptr, int64_t nbytes, int num_threads=0, isa=None, bint prefetch=False):
    """Read nbytes at ptr once with a SIMD path's float max loop (isa: a
    name from ISAS, None: the active path; eight max chains, prefetching
    ahead when asked; num_threads threads, 0: the OpenMP default): the
    memory-speed yardstick of the benchmarks. The caller keeps the buffer
    alive."""
    cdef uint64_t acc
    cdef int which = -1
    if isa is not None:
        if not isa_supported(isa):
            raise ValueError(f"ISA {isa!r} is not available on this machine or build")
        which = ISAS.index(isa)
    with nogil:
        acc = lm_read_pass(<const void *>ptr, nbytes, num_threads, which, prefetch)
    return acc
