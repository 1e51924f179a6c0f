# cython: language_level=3, boundscheck=False, wraparound=False
"""Binding to the native core: turns checked Python arguments into one
lm_job and runs it with the GIL released. All validation happens in the
Python package before this is called; pointers arrive as integers."""

from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint64_t, uintptr_t

cdef extern from "lm_kernel.h" nogil:
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

    int lm_run(const lm_job *job, int64_t *bad_row)
    int lm_isa_supported(int isa)
    int lm_isa_active()
    int lm_isa_set(int isa)
    int lm_isa_best()
    const char *lm_isa_name(int isa)
    int lm_openmp()
    int lm_max_threads()
    uint64_t lm_read_pass(const void *p, int64_t nbytes, int num_threads)

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


cdef void *_addr(object a, int writable) except? NULL:
    """The first byte of a contiguous buffer (a numpy array), NULL for None.
    The caller keeps the object alive while the address is used."""
    cdef Py_buffer view
    cdef void *p
    if a is None:
        return NULL
    PyObject_GetBuffer(a, &view, PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))
    p = view.buf
    PyBuffer_Release(&view)
    return p


def run(int dtype, int64_t n_rows, int64_t n_cols, int64_t rows_inner,
        uintptr_t logits, int64_t row_stride, int64_t outer_stride,
        uintptr_t ref, int64_t ref_row_stride, int64_t ref_outer_stride,
        object targets, int64_t ignore_index, double softcap,
        object nll, object entropy, object argmax,
        object kl, object ref_argmax, object ref_nll, bint totals, int num_threads):
    """Run one job; returns (status, first bad row, NLL sum, rows counted)
    (the totals are 0 unless asked for). targets and the outputs are
    contiguous int64 / float64 arrays of n_rows or None; the caller keeps
    every buffer alive and correctly sized for the duration of the call."""
    cdef lm_job job
    cdef int64_t bad = -1, n_counted = 0
    cdef double nll_sum = 0.0
    cdef int status
    job.dtype = dtype
    job.n_rows = n_rows
    job.n_cols = n_cols
    job.rows_inner = rows_inner
    job.logits.base = <const void *>logits
    job.logits.row_stride = row_stride
    job.logits.outer_stride = outer_stride
    job.ref.base = <const void *>ref
    job.ref.row_stride = ref_row_stride
    job.ref.outer_stride = ref_outer_stride
    job.targets = <const int64_t *>_addr(targets, 0)
    job.ignore_index = ignore_index
    job.softcap = softcap
    job.nll = <double *>_addr(nll, 1)
    job.entropy = <double *>_addr(entropy, 1)
    job.argmax = <int64_t *>_addr(argmax, 1)
    job.kl = <double *>_addr(kl, 1)
    job.ref_argmax = <int64_t *>_addr(ref_argmax, 1)
    job.ref_nll = <double *>_addr(ref_nll, 1)
    job.nll_sum = &nll_sum if totals and nll is not None else NULL
    job.n_counted = &n_counted if totals and targets is not None else NULL
    job.num_threads = num_threads
    with nogil:
        status = lm_run(&job, &bad)
    return status, bad, nll_sum, n_counted


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


def read_pass(uintptr_t ptr, int64_t nbytes, int num_threads=0):
    """Read nbytes at ptr once (OR of 64-bit words): the memory-speed
    yardstick for benchmarks. The caller keeps the buffer alive."""
    cdef uint64_t acc
    with nogil:
        acc = lm_read_pass(<const void *>ptr, nbytes, num_threads)
    return acc
