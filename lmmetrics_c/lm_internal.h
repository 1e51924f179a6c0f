/* Shared between the driver and the per-ISA translation units. */
#ifndef LM_INTERNAL_H
#define LM_INTERNAL_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include "lm_kernel.h"

/* A row is processed in fixed segments so that a long row can be split
 * across threads and the result is the same bits for any thread count. */
#define LM_SEGMENT 32768
/* Inside a segment: blocks that stay in L1 while the next one streams in. */
#define LM_BLOCK 4096
#define LM_PREFETCH_BYTES 16384

/* The state of one segment (or a merged row). Model side: m = the shift
 * of the sums, s = sum exp(z - m), t = sum exp(z - m) * (z - m),
 * mx = max, amax = first argmax. Reference side: rm, rs, rmx, ramax
 * likewise; c = sum exp(r - rm) * ((r - rm) - (z - m)), so that
 * KL = c / rs - log rs + log s. A shift is -inf while its side has seen
 * only -inf. slow: the segment holds +inf, or maxima beyond the kernel's
 * range (the row takes the exact path). */
typedef struct {
    double m, s, t, mx;
    double rm, rs, c, rmx;
    int64_t amax, ramax;
    int slow, nan_found;
} lm_state;

/* The sums' exp: 2^(j/4), j = 0..3, as float bits less j << 21, so that
 * adding t << 21 (t holding 4n + j in its low bits) gives 2^(n + j/4). */
#define LM_POW2Q_TABLE                                                         \
    0x3f800000, 0x3f9837f0 - (1 << 21), 0x3fb504f3 - (2 << 21), 0x3fd744fd - (3 << 21)

enum { LM_WANT_ENT = 1, LM_WANT_AMAX = 2, LM_WANT_REF = 4, LM_WANT_CAP = 8 };

typedef void (*lm_segment_fn)(const void *z, const void *r, int64_t n, int flags,
                              float cap, const void *next, lm_state *st);

/* Scalar element loads, used for targets, argmax searches and slow paths. */
static inline float lm_bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float lm_f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double lm_load1(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case LM_F32: return ((const float *)p)[i];
    case LM_F64: return ((const double *)p)[i];
    case LM_F16: return lm_f16_to_float(((const uint16_t *)p)[i]);
    default: return lm_bf16_to_float(((const uint16_t *)p)[i]);
    }
}

static inline size_t lm_elsize(int dtype) {
    return dtype == LM_F64 ? 8 : dtype == LM_F32 ? 4 : 2;
}

/* A read-only pass: the max of n floats (n a multiple of 64), the
 * kernels' own max loop, for the benchmarks' speed limit. */
typedef float (*lm_read_fn)(const float *p, int64_t n);

/* What each ISA unit exports: its segment kernels indexed by dtype (NULL
 * where the unit has none; f64 always runs the scalar unit) and its read
 * pass. */
typedef struct {
    lm_segment_fn kernels[LM_NDTYPES];
    lm_read_fn read;
} lm_unit;

extern const lm_unit lm_unit_scalar;
#ifdef LM_HAVE_AVX2
extern const lm_unit lm_unit_avx2;
#endif
#ifdef LM_HAVE_AVX512
extern const lm_unit lm_unit_avx512;
#endif

#endif
