# cython: language_level=3, boundscheck=False, wraparound=False
"""Binding to the native core: turns checked Python arguments into one
lm_job and runs it with the GIL released. The Python package validates
everything first; here Cython checks the targets and outputs (typed
memoryviews: dtype, contiguity, length) and holds them for the call. The
logits arrive as (address, row stride, outer stride): their owner is kept
alive by the caller."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport int64_t, uint64_t, uintptr_t

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


cdef void _check_length(object name, Py_ssize_t got, int64_t want) except *:
    if got != want:
        raise ValueError(f"lmmetrics: {name} holds {got} values for {want} rows")


def run(*, int dtype, int64_t n_rows, int64_t n_cols, int64_t rows_inner, tuple logits,
        tuple reference=None, const int64_t[::1] targets=None, int64_t ignore_index=-100,
        double softcap=0.0, double[::1] nll=None, double[::1] entropy=None,
        int64_t[::1] argmax=None, double[::1] kl=None, int64_t[::1] ref_argmax=None,
        double[::1] ref_nll=None, int num_threads=0):
    """Run one job; returns (status, first bad row, NLL sum, rows counted):
    status is an lm_status value (an int), the totals 0 unless targets (and nll) are given.
    ``logits`` and ``reference`` are (address, row_stride, outer_stride) in
    elements; the caller keeps their memory alive. Targets and outputs are
    int64 / float64 of n_rows (or None). A KeyboardInterrupt (or another
    exception from a signal handler) during a call from the main thread
    stops it within milliseconds and is raised here."""
    cdef lm_job job
    cdef int64_t bad = -1, n_counted = 0
    cdef double nll_sum = 0.0
    cdef int status
    cdef list raised = []
    if targets is not None:
        _check_length("targets", targets.shape[0], n_rows)
    if nll is not None:
        _check_length("nll", nll.shape[0], n_rows)
    if entropy is not None:
        _check_length("entropy", entropy.shape[0], n_rows)
    if argmax is not None:
        _check_length("argmax", argmax.shape[0], n_rows)
    if kl is not None:
        _check_length("kl", kl.shape[0], n_rows)
    if ref_argmax is not None:
        _check_length("ref_argmax", ref_argmax.shape[0], n_rows)
    if ref_nll is not None:
        _check_length("ref_nll", ref_nll.shape[0], n_rows)
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
    job.targets = &targets[0] if targets is not None and n_rows else NULL
    job.ignore_index = ignore_index
    job.softcap = softcap
    job.nll = &nll[0] if nll is not None and n_rows else NULL
    job.entropy = &entropy[0] if entropy is not None and n_rows else NULL
    job.argmax = &argmax[0] if argmax is not None and n_rows else NULL
    job.kl = &kl[0] if kl is not None and n_rows else NULL
    job.ref_argmax = &ref_argmax[0] if ref_argmax is not None and n_rows else NULL
    job.ref_nll = &ref_nll[0] if ref_nll is not None and n_rows else NULL
    job.nll_sum = &nll_sum if job.nll != NULL and job.targets != NULL else NULL
    job.n_counted = &n_counted if job.targets != NULL else NULL
    job.num_threads = num_threads
    job.interrupted = NULL
    job.interrupt_arg = <void *>raised
    if PyThread_get_thread_ident() == _MAIN_THREAD:
        job.interrupted = _signalled
    with nogil:
        status = lm_run(&job, &bad)
    if raised:
        raise raised[0]
    return status, bad, nll_sum, n_counted


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
