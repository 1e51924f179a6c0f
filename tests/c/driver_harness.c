/* The driver on aarch64 (tests/core/test_neon_qemu.py, under qemu): lm_run's
 * float64 jobs on the NEON path against the same jobs on the portable
 * path, every per-row output and the totals, with targets, a reference and
 * a softcap or not; and the NEON path is the one chosen. Prints "ok
 * <checks>" and exits 0, or prints each failure and exits 1. */
#include <stdio.h>
#include <stdlib.h>
#include "lm_internal.h"

static int failures = 0, checks = 0;

static void expect(int ok, const char *what, int64_t row, double got, double want) {
    checks++;
    if (!ok && ++failures <= 20) printf("FAIL %s row %lld: got %.17g want %.17g\n", what, (long long)row, got, want);
}

/* float64's contract between the two paths: 1e-13 (1 + |value|) */
static int near(double a, double b) { return a == b || fabs(a - b) <= 1e-13 * (1 + fabs(b)); }

typedef struct { double nll[64], ent[64], kl[64], top[64], sum; int64_t amax[64], ramax[64], rank[64], counted; } outs_t;

static int run(int isa, const double *z, const double *r, const int64_t *t, int64_t rows, int64_t cols, double cap,
               outs_t *o) {
    lm_job j;
    int64_t bad = -1;
    memset(&j, 0, sizeof j);
    j.dtype = LM_F64;
    j.n_rows = rows; j.n_cols = cols; j.rows_inner = rows;
    j.logits.base = z; j.logits.row_stride = cols; j.logits.outer_stride = rows * cols;
    j.ref.base = r; j.ref.row_stride = cols; j.ref.outer_stride = rows * cols;
    j.targets = t; j.ignore_index = -100; j.softcap = cap;
    j.nll = o->nll; j.entropy = o->ent; j.argmax = o->amax; j.rank = o->rank; j.top_logprob = o->top;
    if (r) { j.kl = o->kl; j.ref_argmax = o->ramax; }
    j.nll_sum = &o->sum; j.n_counted = &o->counted; j.num_threads = 1;
    if (lm_isa_set(isa) != 0) return -1;
    return lm_run(&j, &bad);
}

int main(void) {
    const int64_t rows = 64, cols = 5003; /* a row of two segments' worth of blocks and a tail */
    double *z = malloc(rows * cols * 8), *r = malloc(rows * cols * 8);
    int64_t t[64];
    uint64_t s = 0x9e3779b97f4a7c15ull;
    expect(lm_isa_best() == LM_ISA_NEON, "the NEON path chosen", -1, lm_isa_best(), LM_ISA_NEON);
    /* its own float64 kernels: the driver takes the portable unit's only
     * where a unit has none */
    expect(lm_unit_neon.kernels[LM_F64] != NULL && lm_unit_neon.values[LM_F64] != NULL, "NEON float64 kernels", -1,
           lm_unit_neon.kernels[LM_F64] != NULL, 1);
    for (int64_t i = 0; i < rows * cols; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        z[i] = ((double)(s >> 11) / 9007199254740992.0 - 0.5) * 24 + (i / cols % 4 == 1 ? 1e9 : 0);
        r[i] = z[i] * 0.75 + ((s & 0xff) / 256.0);
    }
    for (int64_t i = 0; i < rows; i++) t[i] = i % 7 == 3 ? -100 : (i * 7919) % cols;
    for (int v = 0; v < 4; v++) { /* reference or not, softcap or not */
        const double *ref = v & 1 ? r : NULL, cap = v & 2 ? 50.0 : 0.0;
        outs_t a, b;
        int sa = run(LM_ISA_NEON, z, ref, t, rows, cols, cap, &a), sb = run(LM_ISA_SCALAR, z, ref, t, rows, cols, cap, &b);
        expect(sa == LM_OK && sb == LM_OK, "status", -1, sa, sb);
        expect(near(a.sum, b.sum) && a.counted == b.counted, "nll_sum", -1, a.sum, b.sum);
        for (int64_t i = 0; i < rows; i++) {
            expect(near(a.nll[i], b.nll[i]), "nll", i, a.nll[i], b.nll[i]);
            expect(near(a.ent[i], b.ent[i]), "entropy", i, a.ent[i], b.ent[i]);
            expect(near(a.top[i], b.top[i]), "top_logprob", i, a.top[i], b.top[i]);
            expect(a.amax[i] == b.amax[i], "argmax", i, (double)a.amax[i], (double)b.amax[i]);
            expect(a.rank[i] == b.rank[i], "rank", i, (double)a.rank[i], (double)b.rank[i]);
            if (ref) {
                expect(near(a.kl[i], b.kl[i]), "kl", i, a.kl[i], b.kl[i]);
                expect(a.ramax[i] == b.ramax[i], "ref argmax", i, (double)a.ramax[i], (double)b.ramax[i]);
            }
        }
    }
    free(z); free(r);
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d checks\n", checks);
    return 0;
}
