/* The driver: picks the ISA, splits the job into (row, segment) work items
 * over OpenMP threads, merges segment states in a fixed order and turns
 * them into per-row results. No Python here; the caller releases the GIL. */
#include <stdlib.h>
#include "lm_internal.h"
#include "lm_bench.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this many elements a call runs on one thread (an OpenMP fork costs
 * more than it saves); each further thread needs this much work too. */
#define LM_MIN_WORK_PER_THREAD ((int64_t)1 << 13)
/* Work a thread does between two calls of job->interrupted: a few
 * milliseconds, so that Ctrl-C is acted on promptly. In elements of a
 * 16- or 32-bit buffer without softcap; lm_cost weighs the rest. */
#define LM_CHECK_WORK ((int64_t)1 << 24)

/* ------------------------------------------------------------------ ISA */

#ifdef LM_X86 /* cpuid and xgetbv through lm_port.h */
static int lm_xcr0_has(unsigned mask) {
    return (lm_xgetbv0() & mask) == mask;
}
static int lm_cpu_avx2(void) {
    unsigned r[4];
    if (!lm_cpuid(1, 0, r)) return 0;
    /* OSXSAVE, AVX, FMA, F16C */
    if (!((r[2] >> 27) & 1) || !((r[2] >> 28) & 1) || !((r[2] >> 12) & 1) || !((r[2] >> 29) & 1)) return 0;
    if (!lm_xcr0_has(0x6)) return 0; /* the OS saves xmm and ymm */
    if (!lm_cpuid(7, 0, r)) return 0;
    return (r[1] >> 5) & 1;
}
static int lm_cpu_avx512(void) {
    unsigned r[4];
    if (!lm_cpu_avx2() || !lm_xcr0_has(0xe6)) return 0; /* opmask, zmm */
    if (!lm_cpuid(1, 0, r) || !((r[2] >> 23) & 1)) return 0; /* POPCNT (the rank's count) */
    if (!lm_cpuid(7, 0, r)) return 0;
    return ((r[1] >> 16) & 1) && ((r[1] >> 30) & 1); /* AVX-512F, AVX-512BW */
}
#endif

int lm_isa_supported(int isa) {
    switch (isa) {
    case LM_ISA_SCALAR: return 1;
#ifdef LM_HAVE_AVX2
    case LM_ISA_AVX2: return lm_cpu_avx2();
#endif
#ifdef LM_HAVE_AVX512
    case LM_ISA_AVX512: return lm_cpu_avx512();
#endif
#ifdef LM_HAVE_NEON
    case LM_ISA_NEON: return 1; /* baseline on aarch64 */
#endif
    default: return 0;
    }
}

int lm_isa_best(void) {
    for (int isa = LM_NISAS - 1; isa > 0; isa--)
        if (lm_isa_supported(isa)) return isa;
    return LM_ISA_SCALAR;
}

static int lm_isa_current = -1;

int lm_isa_active(void) {
    if (lm_isa_current < 0) lm_isa_current = lm_isa_best();
    return lm_isa_current;
}

int lm_isa_set(int isa) {
    if (isa < 0 || isa >= LM_NISAS || !lm_isa_supported(isa)) return -1;
    lm_isa_current = isa;
    return 0;
}

const char *lm_isa_name(int isa) {
    static const char *names[LM_NISAS] = {"scalar", "avx2", "avx512", "neon"};
    return isa >= 0 && isa < LM_NISAS ? names[isa] : "unknown";
}

int lm_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int lm_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* fork(): libgomp's thread team does not survive it, and an OpenMP region
 * in the child of a process that had started one waits for ever (Python's
 * multiprocessing with the fork start method, DataLoader workers). The team
 * may be another library's on the same runtime (torch's wheels bring their
 * own libgomp.so.1, which then serves both), so the child of a process that
 * ran more than one thread when it forked runs its jobs on one thread,
 * without a region. Threads are counted in /proc/self/task; where there is
 * none, a forked child always runs on one thread. */
#if defined(_OPENMP) && !defined(_WIN32)
#include <dirent.h>
#include <pthread.h>
static volatile int lm_fork_threads = 0, lm_forked_after_threads = 0;
static pthread_once_t lm_atfork_once = PTHREAD_ONCE_INIT;
static void lm_atfork_prepare(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) { lm_fork_threads = 2; return; }
    for (struct dirent *e; (e = readdir(d)) != NULL;) n += e->d_name[0] != '.';
    closedir(d);
    lm_fork_threads = n;
}
static void lm_atfork_child(void) {
    if (lm_fork_threads > 1) lm_forked_after_threads = 1;
}
static void lm_atfork_register(void) { pthread_atfork(lm_atfork_prepare, NULL, lm_atfork_child); }
#endif

void lm_init(void) {
#if defined(_OPENMP) && !defined(_WIN32)
    pthread_once(&lm_atfork_once, lm_atfork_register);
#endif
}

/* The threads a job may use: nt (>= 1), or 1 in a child forked from a
 * process that ran threads; the caller starts a team when it gets more
 * than 1. */
static int lm_team(int nt) {
#if defined(_OPENMP) && !defined(_WIN32)
    if (nt <= 1 || lm_forked_after_threads) return 1;
#endif
    return nt < 1 ? 1 : nt;
}

static const lm_unit *lm_unit_for(int isa) {
#ifdef LM_HAVE_NEON
    if (isa == LM_ISA_NEON) return &lm_unit_neon;
#endif
#ifdef LM_HAVE_AVX512
    if (isa == LM_ISA_AVX512) return &lm_unit_avx512;
#endif
#ifdef LM_HAVE_AVX2
    if (isa == LM_ISA_AVX2) return &lm_unit_avx2;
#endif
    (void)isa;
    return &lm_unit_scalar;
}

/* the kernel for dtype on isa: the portable unit's where the ISA has none
 * (every SIMD unit has all four dtypes today) */
static lm_segment_fn lm_kernel_for(int isa, int dtype) {
    lm_segment_fn fn = lm_unit_for(isa)->kernels[dtype];
    return fn ? fn : lm_unit_scalar.kernels[dtype];
}

/* the lane values of that kernel (the same unit) */
static lm_value_fn lm_value_for(int isa, int dtype) {
    return lm_unit_for(isa)->kernels[dtype] ? lm_unit_for(isa)->values[dtype]
                                            : lm_unit_scalar.values[dtype];
}

/* A read-only pass over a buffer (the speed limit the benchmarks compare
 * with): an ISA's float max loop over 64 KB chunks, split across threads;
 * the bytes after the last whole chunk are ORed. */
uint64_t lm_read_pass(const void *p, int64_t nbytes, int num_threads, int isa, int prefetch) {
    const int64_t chunk = 16384; /* floats */
    const int64_t nchunks = nbytes / 4 / chunk;
    const unsigned char *tail = (const unsigned char *)p + nchunks * chunk * 4;
    lm_read_fn fn = lm_unit_for(isa < 0 ? lm_isa_active() : lm_isa_supported(isa) ? isa : LM_ISA_SCALAR)->read;
    float m = -INFINITY;
    uint64_t acc = 0;
    uint32_t bits;
    int nt = lm_team(num_threads > 0 ? num_threads : lm_max_threads());
    (void)nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(max : m) if (nt > 1)
#endif
    for (int64_t c = 0; c < nchunks; c++) {
        float v = fn((const float *)p + c * chunk, chunk, prefetch);
        m = v > m ? v : m;
    }
    for (int64_t i = 0; i < nbytes - nchunks * chunk * 4; i++) acc |= tail[i];
    memcpy(&bits, &m, 4);
    return acc | bits;
}

/* ----------------------------------------------------------------- rows */

typedef struct {
    const lm_job *job;
    lm_segment_fn fn;
    lm_value_fn value; /* the kernel's lane values (the rank's threshold) */
    int flags;
    int64_t seg, nseg; /* segment length (lm_segment_len), segments a row */
    size_t es;
} lm_ctx;

/* The segment length of a job's rows: LM_SEGMENT, or half the row of a
 * one-row job of LM_SPLIT_MIN to 2 x LM_SEGMENT elements (rounded up to 8
 * elements) */
static int64_t lm_segment_len(int64_t n_rows, int64_t n_cols) {
    if (n_rows != 1 || n_cols < LM_SPLIT_MIN || n_cols > 2 * LM_SEGMENT) return LM_SEGMENT;
    return ((n_cols + 1) / 2 + 7) & ~(int64_t)7;
}

static const char *lm_row(const lm_ctx *x, const lm_buffer *b, int64_t i) {
    const lm_job *j = x->job;
    int64_t off = (i / j->rows_inner) * b->outer_stride + (i % j->rows_inner) * b->row_stride;
    return (const char *)b->base + off * (int64_t)x->es;
}

static int lm_counted(const lm_job *j, int64_t i) {
    if (!j->targets) return 1;
    int64_t t = j->targets[i];
    return t >= 0 && t != j->ignore_index;
}

/* The rank's threshold for row i: its target's logit as the kernel's
 * lanes hold it (capped by the same code) [README: rank]; +inf without
 * rank or for a target out of range (an error later): nothing counted but
 * +inf values, whose row takes the exact path. */
static double lm_rank_threshold(const lm_ctx *x, int64_t i) {
    const lm_job *j = x->job;
    if (!j->rank || j->targets[i] < 0 || j->targets[i] >= j->n_cols) return INFINITY;
    return x->value(lm_row(x, &j->logits, i), j->targets[i], j->softcap);
}

static void lm_segment(const lm_ctx *x, int64_t i, int64_t s, lm_state *st) {
    const lm_job *j = x->job;
    const int64_t lo = s * x->seg;
    const int64_t n = j->n_cols - lo < x->seg ? j->n_cols - lo : x->seg;
    const char *z = lm_row(x, &j->logits, i) + lo * (int64_t)x->es;
    const char *r = j->ref.base ? lm_row(x, &j->ref, i) + lo * (int64_t)x->es : NULL;
    const void *next = NULL, *next_ref = NULL; /* what to prefetch while the segment ends */
    if (s + 1 < x->nseg) {
        next = z + n * (int64_t)x->es;
        next_ref = r ? r + n * (int64_t)x->es : NULL;
    } else if (i + 1 < j->n_rows) {
        next = lm_row(x, &j->logits, i + 1);
        next_ref = r ? lm_row(x, &j->ref, i + 1) : NULL;
    }
    /* the rank's threshold, and the target's index in the segment */
    x->fn(z, r, n, x->flags, j->softcap, lm_rank_threshold(x, i), j->rank ? j->targets[i] - lo : 0, next,
          next_ref, st);
}

/* scale factor of a side with shift m and sum s to a common shift to */
static double lm_scale(double m, double s, double to) {
    return s == 0.0 ? 0.0 : exp(m - to);
}

/* the cross term of x moved to the common shifts (to, ref_to): each of its
 * terms e_r ((r - ref_shift) - (z - shift)) becomes
 * a e_r ((r - ref_to) - (z - to)) [README: merging] */
static double lm_cross(const lm_state *x, double to, double ref_to) {
    double a = lm_scale(x->ref_shift, x->ref_sum, ref_to);
    if (a == 0.0) return 0.0;
    return a * (x->cross + ((to == x->shift ? 0.0 : to - x->shift) + (x->ref_shift - ref_to)) * x->ref_sum);
}

/* a <- a followed by b (b's indices start at offset) */
static void lm_merge(lm_state *a, const lm_state *b, int64_t offset) {
    double to = a->shift > b->shift ? a->shift : b->shift;
    double ref_to = a->ref_shift > b->ref_shift ? a->ref_shift : b->ref_shift;
    double ea = lm_scale(a->shift, a->sum, to), eb = lm_scale(b->shift, b->sum, to);
    a->cross = lm_cross(a, to, ref_to) + lm_cross(b, to, ref_to);
    a->dsum = (ea != 0.0 ? ea * (a->dsum + (a->shift - to) * a->sum) : 0.0) +
              (eb != 0.0 ? eb * (b->dsum + (b->shift - to) * b->sum) : 0.0);
    a->sum = a->sum * ea + b->sum * eb;
    if (b->max > a->max) {
        if (b->argmax >= 0) a->argmax = b->argmax + offset;
        a->max = b->max;
    }
    a->shift = to;
    ea = lm_scale(a->ref_shift, a->ref_sum, ref_to);
    eb = lm_scale(b->ref_shift, b->ref_sum, ref_to);
    a->ref_sum = a->ref_sum * ea + b->ref_sum * eb;
    if (b->ref_max > a->ref_max) {
        if (b->ref_argmax >= 0) a->ref_argmax = b->ref_argmax + offset;
        a->ref_max = b->ref_max;
    }
    a->ref_shift = ref_to;
    a->exact |= b->exact;
    a->nan |= b->nan;
    a->rank += b->rank;
}

/* the softcap in double: the target's logit, and the exact path (the
 * kernels cap in their lanes' type, within a few ulps of this) */
static double lm_cap(const lm_job *j, double v) {
    return j->softcap > 0 ? lm_softcap(v, j->softcap) : v;
}

/* NLL, entropy and KL are >= 0 exactly; rounding may leave -1e-16 */
static double lm_nonneg(double v) { return v <= 0.0 ? 0.0 : v; }

/* One side of a row, exactly, in double: how many +inf, the max m and
 * ls = log sum exp(z - m) over the finite part (log-probabilities are
 * (z - m) - ls, never z - (m + ls), which loses z - m when m is large),
 * entropy, first argmax. Used only for rows a kernel marks exact (+inf,
 * maxima beyond its range, or a KL cross term beyond float sums). */
typedef struct { int64_t ninf, amax; double m, ls, ent; int nan; } lm_exact;

static lm_exact lm_exact_side(const lm_job *j, const void *p) {
    lm_exact e = {0, -1, -INFINITY, 0.0, 0.0, 0};
    double s = 0.0, t = 0.0;
    for (int64_t k = 0; k < j->n_cols; k++) {
        double v = lm_cap(j, lm_load1(p, j->dtype, k));
        if (isnan(v)) e.nan = 1;
        else if (v == INFINITY) { if (!e.ninf++) e.amax = k; }
        else if (v > e.m) { e.m = v; if (!e.ninf) e.amax = k; }
    }
    if (e.ninf) { e.ent = log((double)e.ninf); return e; }
    if (e.m == -INFINITY) return e;
    for (int64_t k = 0; k < j->n_cols; k++) {
        double d = lm_cap(j, lm_load1(p, j->dtype, k)) - e.m;
        if (d == -INFINITY) continue;
        s += exp(d);
        t += exp(d) * d;
    }
    e.ls = log(s);
    e.ent = e.ls - t / s;
    return e;
}

/* log of the probability of entry k under a side */
static double lm_exact_logp(const lm_job *j, const lm_exact *e, const void *p, int64_t k) {
    double v = lm_cap(j, lm_load1(p, j->dtype, k));
    if (e->ninf) return v == INFINITY ? -log((double)e->ninf) : -INFINITY;
    return (v - e->m) - e->ls;
}

/* s + v into the Neumaier pair (s, c): c gathers what s's rounding lost
 * (nothing once s is no longer finite); the sum is s + c */
static inline void lm_compensated_add(double *s, double *c, double v) {
    double t = *s + v;
    if (isfinite(t)) *c += fabs(*s) >= fabs(v) ? (*s - t) + v : (v - t) + *s;
    *s = t;
}

static int lm_row_exact(const lm_ctx *x, int64_t i) {
    const lm_job *j = x->job;
    const char *z = lm_row(x, &j->logits, i), *r = j->ref.base ? lm_row(x, &j->ref, i) : NULL;
    lm_exact ez = lm_exact_side(j, z), er;
    if (ez.nan) return LM_ERR_NAN;
    if (ez.m == -INFINITY && !ez.ninf) return LM_ERR_EMPTY;
    if (j->nll) j->nll[i] = lm_nonneg(-lm_exact_logp(j, &ez, z, j->targets[i]));
    if (j->entropy) j->entropy[i] = lm_nonneg(ez.ent);
    if (j->argmax) j->argmax[i] = ez.amax;
    /* the top token's log-probability: its share of the +inf entries, or
     * (m - m) - ls */
    if (j->top_logprob) j->top_logprob[i] = ez.ninf ? -log((double)ez.ninf) : -ez.ls;
    if (j->rank) { /* the kernel's rule, value by value (lm_value_fn): above, or tied before */
        const int64_t t = j->targets[i];
        const double thr = x->value(z, t, j->softcap);
        int64_t c = 0;
        for (int64_t k = 0; k < j->n_cols; k++) {
            const double v = x->value(z, k, j->softcap);
            c += v > thr || (k < t && v == thr);
        }
        j->rank[i] = c;
    }
    if (!r) return LM_OK;
    er = lm_exact_side(j, r);
    if (er.nan) return LM_ERR_NAN_REF;
    if (er.m == -INFINITY && !er.ninf) return LM_ERR_EMPTY_REF;
    if (j->ref_argmax) j->ref_argmax[i] = er.amax;
    if (j->ref_nll) j->ref_nll[i] = lm_nonneg(-lm_exact_logp(j, &er, r, j->targets[i]));
    if (j->kl) {
        /* term by term, over the entries whose reference probability is
         * above 0 in double (as a float64 reference computes it): such an
         * entry the model rules out makes KL inf */
        double kl = 0.0, c = 0.0; /* compensated: a row of huge terms keeps 1e-13 */
        for (int64_t k = 0; k < j->n_cols; k++) {
            double lp = lm_exact_logp(j, &er, r, k), p = exp(lp);
            if (p > 0.0) lm_compensated_add(&kl, &c, p * (lp - lm_exact_logp(j, &ez, z, k)));
        }
        j->kl[i] = lm_nonneg(kl + c);
    }
    return LM_OK;
}

static int lm_finish(const lm_ctx *x, int64_t i, const lm_state *st) {
    const lm_job *j = x->job;
    if (j->targets && j->targets[i] >= j->n_cols) return LM_ERR_TARGET; /* before any use */
    if (st->nan & 1 || isnan(st->sum) || isnan(st->dsum)) return LM_ERR_NAN;
    if (st->exact) return lm_row_exact(x, i);
    if (st->shift == -INFINITY) return LM_ERR_EMPTY;
    if (j->ref.base) {
        if (st->nan & 2 || isnan(st->ref_sum) || isnan(st->cross)) return LM_ERR_NAN_REF;
        if (st->ref_shift == -INFINITY) return LM_ERR_EMPTY_REF;
    }
    double ls = log(st->sum);
    if (j->nll) {
        const char *z = lm_row(x, &j->logits, i);
        j->nll[i] = lm_nonneg((st->shift - lm_cap(j, lm_load1(z, j->dtype, j->targets[i]))) + ls);
    }
    if (j->entropy) j->entropy[i] = lm_nonneg(ls - st->dsum / st->sum);
    if (j->argmax) j->argmax[i] = st->argmax;
    if (j->rank) j->rank[i] = st->rank;
    /* log p of the top token: (max - shift) - log sum, <= 0 (the max's own
     * term is in the sum, exactly [README: fix]) */
    if (j->top_logprob) {
        const double t = (st->max - st->shift) - ls;
        j->top_logprob[i] = t < 0.0 ? t : 0.0;
    }
    if (j->kl) j->kl[i] = lm_nonneg(st->cross / st->ref_sum - log(st->ref_sum) + ls);
    if (j->ref_argmax) j->ref_argmax[i] = st->ref_argmax;
    if (j->ref_nll) {
        const char *r = lm_row(x, &j->ref, i);
        j->ref_nll[i] = lm_nonneg((st->ref_shift - lm_cap(j, lm_load1(r, j->dtype, j->targets[i]))) +
                                  log(st->ref_sum));
    }
    return LM_OK;
}

static void lm_skip(const lm_job *j, int64_t i) {
    if (j->nll) j->nll[i] = 0.0;
    if (j->entropy) j->entropy[i] = 0.0;
    if (j->argmax) j->argmax[i] = -1;
    if (j->kl) j->kl[i] = 0.0;
    if (j->ref_argmax) j->ref_argmax[i] = -1;
    if (j->ref_nll) j->ref_nll[i] = 0.0;
    if (j->rank) j->rank[i] = -1;
    if (j->top_logprob) j->top_logprob[i] = 0.0;
}

static int lm_whole_row(const lm_ctx *x, int64_t i) {
    lm_state acc, st;
    if (!lm_counted(x->job, i)) { lm_skip(x->job, i); return LM_OK; }
    lm_segment(x, i, 0, &acc);
    for (int64_t s = 1; s < x->nseg; s++) {
        lm_segment(x, i, s, &st);
        lm_merge(&acc, &st, s * x->seg);
    }
    return lm_finish(x, i, &acc);
}

/* the totals, in row order: Neumaier-compensated sum of the NLL, count */
static void lm_totals(const lm_job *j) {
    double s = 0.0, c = 0.0;
    int64_t k = 0;
    for (int64_t i = 0; i < j->n_rows; i++) {
        if (!lm_counted(j, i)) continue;
        k++;
        if (j->nll) lm_compensated_add(&s, &c, j->nll[i]);
    }
    if (j->nll_sum) *j->nll_sum = s + c;
    if (j->n_counted) *j->n_counted = k;
}

/* Interrupt polling inside a parallel region: thread 0 (the thread that
 * called lm_run, which may call back into its caller) asks
 * job->interrupted after every `every` work items of its own; `stop` is
 * read by every thread before each item. */
typedef struct {
    const lm_job *job;
    int64_t every, done; /* done: thread 0's items since it last asked */
    int stop;
} lm_poll;

static int lm_stopped(lm_poll *p) {
    int v;
#ifdef _OPENMP
#pragma omp atomic read
#endif
    v = p->stop;
    return v;
}

static void lm_poll_step(lm_poll *p) {
#ifdef _OPENMP
    if (omp_get_thread_num() != 0) return;
#endif
    if (!p->job->interrupted || ++p->done < p->every) return;
    p->done = 0;
    if (p->job->interrupted(p->job->interrupt_arg)) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        p->stop = 1;
    }
}

/* row i whole, unless the job was stopped; its status into status[i] */
static void lm_row_item(const lm_ctx *x, lm_poll *poll, unsigned char *status, int64_t i) {
    if (lm_stopped(poll)) return;
    status[i] = (unsigned char)lm_whole_row(x, i);
    lm_poll_step(poll);
}

/* the cost of an element of the job relative to LM_CHECK_WORK's unit:
 * float64 (twice the vectors; libm's exp on the portable unit) and a
 * softcap take longer, a reference doubles it */
static int64_t lm_cost(const lm_job *j, lm_segment_fn fn) {
    const int64_t f64 = fn == lm_unit_scalar.kernels[LM_F64] ? 8 : 2;
    return (j->dtype == LM_F64 ? f64 : 1) * (j->softcap > 0 ? 4 : 1) * (j->ref.base ? 2 : 1);
}

int lm_run(const lm_job *j, int64_t *bad_row) {
    lm_ctx x;
    int64_t n = j->n_rows, work;
    int nt, isa, err = LM_OK;
    unsigned char *status;

    *bad_row = -1;
    if (n < 0 || j->n_cols < 1 || j->rows_inner < 1 || j->dtype < 0 || j->dtype >= LM_NDTYPES ||
        !j->logits.base || ((j->nll || j->ref_nll || j->rank || j->nll_sum || j->n_counted) && !j->targets) ||
        (j->nll_sum && !j->nll) ||
        ((j->kl || j->ref_argmax || j->ref_nll) && !j->ref.base))
        return LM_ERR_ARGS;
    if (n == 0) {
        if (j->nll_sum) *j->nll_sum = 0.0;
        if (j->n_counted) *j->n_counted = 0;
        return LM_OK;
    }
    x.job = j;
    isa = lm_isa_active(); /* (read once: the kernel and its value function of one path) */
    x.fn = lm_kernel_for(isa, j->dtype);
    x.value = lm_value_for(isa, j->dtype);
    x.es = lm_elsize(j->dtype);
    x.seg = lm_segment_len(n, j->n_cols);
    x.nseg = (j->n_cols + x.seg - 1) / x.seg;
    /* entropy and argmax only when asked (KL alone skips them: 15-25% of
     * its work); the sums and the cross term are the same bits either way */
    x.flags = (j->entropy || j->argmax || j->ref_argmax ? LM_WANT_ENT | LM_WANT_AMAX : 0) |
              (j->ref.base ? LM_WANT_REF : 0) | (j->softcap > 0 ? LM_WANT_CAP : 0) |
              (j->rank ? LM_WANT_RANK : 0);

    nt = j->num_threads > 0 ? j->num_threads : lm_max_threads();
    work = n * j->n_cols * (j->ref.base ? 2 : 1);
    if (work / LM_MIN_WORK_PER_THREAD < nt) nt = (int)(work / LM_MIN_WORK_PER_THREAD);
    if (nt < 1) nt = 1;
    if (nt > n && x.nseg == 1) nt = (int)n; /* whole rows: a thread a row at most */
    nt = lm_team(nt);

    status = (unsigned char *)calloc((size_t)n, 1);
    if (!status) return LM_ERR_NOMEM;

    /* One parallel region: the calling thread (thread 0) asks
     * job->interrupted every LM_CHECK_WORK elements of its own work, and
     * once it says stop every thread skips what is left (lm_poll). */
    if (nt > 1 && n < nt && x.nseg > 1) {
        /* few long rows: split them into segments across threads */
        int64_t items = n * x.nseg;
        lm_poll poll = {j, LM_CHECK_WORK / x.seg / lm_cost(j, x.fn), 0, 0};
        lm_state *sts = (lm_state *)malloc((size_t)items * sizeof(lm_state));
        if (!sts) { free(status); return LM_ERR_NOMEM; }
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
        for (int64_t k = 0; k < items; k++) {
            if (lm_stopped(&poll)) continue;
            if (lm_counted(j, k / x.nseg)) lm_segment(&x, k / x.nseg, k % x.nseg, &sts[k]);
            lm_poll_step(&poll);
        }
        if (poll.stop) err = LM_INTERRUPTED;
        for (int64_t i = 0; i < n && !err; i++) {
            lm_state *acc = &sts[i * x.nseg];
            if (!lm_counted(j, i)) { lm_skip(j, i); continue; }
            for (int64_t s = 1; s < x.nseg; s++) lm_merge(acc, &sts[i * x.nseg + s], s * x.seg);
            status[i] = (unsigned char)lm_finish(&x, i, acc);
        }
        free(sts);
    } else {
        lm_poll poll = {j, LM_CHECK_WORK / (j->n_cols * lm_cost(j, x.fn)), 0, 0};
        if (nt == 1) { /* no OpenMP region: 0.6 us a call less, which a one-row call sees */
            for (int64_t i = 0; i < n; i++) lm_row_item(&x, &poll, status, i);
        } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
            for (int64_t i = 0; i < n; i++) lm_row_item(&x, &poll, status, i);
        }
        if (poll.stop) err = LM_INTERRUPTED;
    }
    for (int64_t i = 0; i < n && !err; i++) {
        if (status[i]) { err = status[i]; *bad_row = i; }
    }
    free(status);
    if (!err) lm_totals(j);
    return err;
}
