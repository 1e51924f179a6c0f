# cython: language_level=3, boundscheck=False, wraparound=False
"""Binding to the native core: turns checked Python arguments into one
lm_job and runs it with the GIL released. All validation happens in the
Python package before this is called; pointers arrive as integers."""

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
    """
    const char *LM_CFLAGS
    const char *LM_ISAS_BUILT

DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
ISAS = ("scalar", "avx2", "avx512")
CFLAGS = LM_CFLAGS.decode()
ISAS_BUILT = tuple(LM_ISAS_BUILT.decode().split())


def run(int dtype, int64_t n_rows, int64_t n_cols, int64_t rows_inner,
        uintptr_t logits, int64_t row_stride, int64_t outer_stride,
        uintptr_t ref, int64_t ref_row_stride, int64_t ref_outer_stride,
        uintptr_t targets, int64_t ignore_index, double softcap,
        uintptr_t nll, uintptr_t entropy, uintptr_t argmax,
        uintptr_t kl, uintptr_t ref_argmax, uintptr_t ref_nll, int num_threads):
    """Run one job; returns (status, first bad row). The caller keeps every
    buffer alive and correctly sized for the duration of the call."""
    cdef lm_job job
    cdef int64_t bad = -1
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
    job.targets = <const int64_t *>targets
    job.ignore_index = ignore_index
    job.softcap = softcap
    job.nll = <double *>nll
    job.entropy = <double *>entropy
    job.argmax = <int64_t *>argmax
    job.kl = <double *>kl
    job.ref_argmax = <int64_t *>ref_argmax
    job.ref_nll = <double *>ref_nll
    job.num_threads = num_threads
    with nogil:
        status = lm_run(&job, &bad)
    return status, bad


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
