/* lmmetrics native core: public C API (no Python.h).
 *
 * One job describes a logits buffer of n_rows rows of n_cols entries (the
 * vocabulary axis is contiguous), an optional reference buffer of the same
 * shape and dtype (for KL), optional targets, and the per-row outputs wanted.
 * Row i starts at  base + (i / rows_inner) * outer_stride
 *                       + (i % rows_inner) * row_stride      (in elements),
 * which covers contiguous buffers and the usual shifted view logits[:, :-1].
 */
#ifndef LM_KERNEL_H
#define LM_KERNEL_H

#include <stdint.h>

enum lm_dtype { LM_F32 = 0, LM_F64 = 1, LM_F16 = 2, LM_BF16 = 3, LM_NDTYPES = 4 };
enum lm_isa { LM_ISA_SCALAR = 0, LM_ISA_AVX2 = 1, LM_ISA_AVX512 = 2, LM_ISA_NEON = 3, LM_NISAS = 4 };

enum lm_status {
    LM_OK = 0,
    LM_ERR_NAN = 1,        /* NaN in the logits of a counted row */
    LM_ERR_NAN_REF = 2,    /* NaN in the reference logits */
    LM_ERR_EMPTY = 3,      /* a counted row is all -inf */
    LM_ERR_EMPTY_REF = 4,  /* a reference row is all -inf */
    LM_ERR_ARGS = 5,       /* inconsistent job (a bug in the caller) */
    LM_ERR_NOMEM = 6,
    LM_ERR_TARGET = 7,     /* a counted target >= n_cols */
    LM_INTERRUPTED = 8     /* job->interrupted said stop (the outputs are partial) */
};

typedef struct {
    const void *base;        /* first element of row 0 */
    int64_t row_stride;      /* elements between consecutive rows */
    int64_t outer_stride;    /* elements between groups of rows_inner rows */
} lm_buffer;

typedef struct {
    int dtype;               /* enum lm_dtype, shared by logits and ref */
    int64_t n_rows, n_cols, rows_inner;
    lm_buffer logits;
    lm_buffer ref;           /* ref.base == NULL: no reference */
    const int64_t *targets;  /* NULL: every row is counted and no NLL */
    int64_t ignore_index;    /* negative targets are ignored as well */
    double softcap;          /* > 0: z -> softcap * tanh(z / softcap) */
    /* per-row outputs; NULL when not wanted; ignored rows get 0 / -1 */
    double *nll;
    double *entropy;
    int64_t *argmax;
    double *kl;
    int64_t *ref_argmax;
    double *ref_nll;         /* NLL of the target under the reference */
    int64_t *rank;           /* logits above the target's (needs targets) [README: rank] */
    double *top_logprob;     /* log-probability of the top token, <= 0 */
    /* totals over rows, in row order; NULL when not wanted (need targets) */
    double *nll_sum;         /* sum of nll (compensated) */
    int64_t *n_counted;      /* rows counted */
    int num_threads;         /* <= 0: the OpenMP default */
    /* optional: called between chunks of rows (about 2^24 elements a thread,
     * a few ms) from the calling thread, outside parallel regions; nonzero
     * stops the job with LM_INTERRUPTED (e.g. to act on Ctrl-C) */
    int (*interrupted)(void *arg);
    void *interrupt_arg;
} lm_job;

/* Runs the job with the GIL released by the caller. Returns an lm_status;
 * for a row error, *bad_row is the first offending row. */
int lm_run(const lm_job *job, int64_t *bad_row);

int lm_isa_supported(int isa);   /* compiled in and supported by this CPU */
int lm_isa_active(void);
int lm_isa_set(int isa);         /* returns 0, or -1 if not supported */
int lm_isa_best(void);
const char *lm_isa_name(int isa);
int lm_openmp(void);             /* 1 when built with OpenMP */
int lm_max_threads(void);
/* once, before any job: the fork guard (a child forked from a process
 * that ran threads computes on one thread) */
void lm_init(void);

#endif
