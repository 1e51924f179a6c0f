/* Shared between the driver and the per-ISA translation units. */
#ifndef LM_INTERNAL_H
#define LM_INTERNAL_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include "lm_kernel.h"
#include "lm_port.h"

/* A row is processed in segments so that a long row can be split across
 * threads and the result is the same bits for any thread count: 32768
 * elements, except that a job of one row of LM_SPLIT_MIN to 2 x LM_SEGMENT
 * elements cuts it into two halves, so that a one-row call runs on two
 * threads (in a batch a row stays whole: each segment costs about 0.4 us
 * of merging and first looks, 7% of a 32000-element row on one thread).
 * The length depends on the job's shape only (lm_segment_len). */
#define LM_SEGMENT 32768
#define LM_SPLIT_MIN 16384
/* Inside a segment: blocks that stay in L1 while the next one streams in. */
#define LM_BLOCK 4096
/* how far ahead the kernels prefetch: 4 KB (64 lines) covers the memory's
 * latency at one core's bandwidth; 8-64 KB measured slower on Zen 4 (its
 * non-temporal lines likely evicted before use) [README: prefetch] */
#define LM_PREFETCH_BYTES 4096
/* the cache line: the kernels prefetch each line once */
#define LM_LINE 64

/* The state of one segment (or a merged row) [README: the state]. The
 * model side's sums are taken against a shift >= its max:
 *   sum = sum e, e = exp(z - shift);  dsum = sum e (z - shift),
 * so that log sum exp(z) = shift + log sum, the NLL of target y is
 * (shift - z_y) + log sum and the entropy log sum - dsum / sum. The
 * reference side's likewise (ref_shift, ref_sum), and
 *   cross = sum e_r ((r - ref_shift) - (z - shift)),
 * so that KL(ref || model) = cross / ref_sum - log ref_sum + log sum.
 * A shift (and max) is -inf while its side has seen only -inf. */
typedef struct {
    double shift, sum, dsum, max;
    double ref_shift, ref_sum, cross, ref_max;
    int64_t argmax, ref_argmax; /* first index of the max; -1: none, or not asked */
    int64_t rank;               /* the rank's count (LM_WANT_RANK): values above the
                                 * target's, and equal to it before it */
    int exact;                  /* +inf, maxima beyond the kernel's range, or a cross
                                 * term beyond float sums: the row takes the exact path */
    int nan;                    /* 1: NaN in the model's logits, 2: in the reference's */
} lm_state;

#define LM_LN2F 0.693147182464599609375 /* ln 2 rounded to float, exactly */
/* 1.5 * 2^23: t = x + MAGIC holds round(x) in its low mantissa bits */
#define LM_MAGIC 12582912.0f

/* the softcap in double: the float64 kernel and the exact path */
static inline double lm_softcap(double x, double c) { return c * tanh(x / c); }


/* The sums' exp takes 2^(j/Q), j < Q = 2^LM_QBITS (an ISA's choice), from
 * a table of float bits less j << (23 - LM_QBITS), so that adding t's
 * bits shifted by 23 - LM_QBITS (t holding Qn + j in its low bits) gives
 * 2^(n + j/Q). Q = 4 (NEON: one byte-table lookup), 8 (AVX2: one
 * cross-lane permute), 16 (AVX-512: one one-register permute) or 32 (the
 * portable path: an array). */
#define LM_POW2Q_TABLE4                                                        \
    0x3f800000, 0x3f9837f0 - (1 << 21), 0x3fb504f3 - (2 << 21), 0x3fd744fd - (3 << 21)
#define LM_Q8(j, bits) ((int)((bits) - ((j) << 20)))
#define LM_POW2Q_TABLE8                                                        \
    LM_Q8(0, 0x3f800000), LM_Q8(1, 0x3f8b95c2), LM_Q8(2, 0x3f9837f0), LM_Q8(3, 0x3fa5fed7),\
    LM_Q8(4, 0x3fb504f3), LM_Q8(5, 0x3fc5672a), LM_Q8(6, 0x3fd744fd), LM_Q8(7, 0x3feac0c7)
#define LM_Q16(j, bits) ((int)((bits) - ((j) << 19)))
#define LM_POW2Q_TABLE16                                                       \
    LM_Q16(0, 0x3f800000), LM_Q16(1, 0x3f85aac3), LM_Q16(2, 0x3f8b95c2), LM_Q16(3, 0x3f91c3d3),\
    LM_Q16(4, 0x3f9837f0), LM_Q16(5, 0x3f9ef532), LM_Q16(6, 0x3fa5fed7), LM_Q16(7, 0x3fad583f),\
    LM_Q16(8, 0x3fb504f3), LM_Q16(9, 0x3fbd08a4), LM_Q16(10, 0x3fc5672a), LM_Q16(11, 0x3fce248c),\
    LM_Q16(12, 0x3fd744fd), LM_Q16(13, 0x3fe0ccdf), LM_Q16(14, 0x3feac0c7), LM_Q16(15, 0x3ff5257d)
#define LM_Q32(j, bits) ((int)((bits) - ((j) << 18)))
#define LM_POW2Q_TABLE32_LO                                                    \
    LM_Q32(0, 0x3f800000), LM_Q32(1, 0x3f82cd87), LM_Q32(2, 0x3f85aac3), LM_Q32(3, 0x3f88980f),\
    LM_Q32(4, 0x3f8b95c2), LM_Q32(5, 0x3f8ea43a), LM_Q32(6, 0x3f91c3d3), LM_Q32(7, 0x3f94f4f0),\
    LM_Q32(8, 0x3f9837f0), LM_Q32(9, 0x3f9b8d3a), LM_Q32(10, 0x3f9ef532), LM_Q32(11, 0x3fa27043),\
    LM_Q32(12, 0x3fa5fed7), LM_Q32(13, 0x3fa9a15b), LM_Q32(14, 0x3fad583f), LM_Q32(15, 0x3fb123f6)
#define LM_POW2Q_TABLE32_HI                                                    \
    LM_Q32(16, 0x3fb504f3), LM_Q32(17, 0x3fb8fbaf), LM_Q32(18, 0x3fbd08a4), LM_Q32(19, 0x3fc12c4d),\
    LM_Q32(20, 0x3fc5672a), LM_Q32(21, 0x3fc9b9be), LM_Q32(22, 0x3fce248c), LM_Q32(23, 0x3fd2a81e),\
    LM_Q32(24, 0x3fd744fd), LM_Q32(25, 0x3fdbfbb8), LM_Q32(26, 0x3fe0ccdf), LM_Q32(27, 0x3fe5b907),\
    LM_Q32(28, 0x3feac0c7), LM_Q32(29, 0x3fefe4ba), LM_Q32(30, 0x3ff5257d), LM_Q32(31, 0x3ffa83b3)

/* The float64 lanes' exp (lm_simd_*_f64.h) takes 2^(j/8) likewise, from
 * double bits less j << 49: F(j, bits) for each entry, F an ISA's way of
 * spelling the table (whole 64-bit entries, or their 32-bit halves). */
#define LM_POW2Q64_TABLE8(F)                                                   \
    F(0, 0x3ff0000000000000ull), F(1, 0x3ff172b83c7d517bull), F(2, 0x3ff306fe0a31b715ull),\
    F(3, 0x3ff4bfdad5362a27ull), F(4, 0x3ff6a09e667f3bcdull), F(5, 0x3ff8ace5422aa0dbull),\
    F(6, 0x3ffae89f995ad3adull), F(7, 0x3ffd5818dcfba487ull)
#define LM_Q8D_BITS(j, bits) ((bits) - ((unsigned long long)(j) << 49))
#define LM_Q8D(j, bits) ((long long)LM_Q8D_BITS(j, bits))
#define LM_Q8D_LO(j, bits) ((int)(unsigned)(LM_Q8D_BITS(j, bits) & 0xffffffffull))
#define LM_Q8D_HI(j, bits) ((int)(unsigned)(LM_Q8D_BITS(j, bits) >> 32))
/* 1.5 * 2^52: t = x + LM_MAGIC64 holds round(x) in its low mantissa bits */
#define LM_MAGIC64 6755399441055744.0

enum { LM_WANT_ENT = 1, LM_WANT_AMAX = 2, LM_WANT_REF = 4, LM_WANT_CAP = 8, LM_WANT_RANK = 16 };

/* A segment into *st; with LM_WANT_RANK, st->rank counts its (capped)
 * values that rank before the target's: those above thr, a lane value
 * (lm_value_fn), and those equal to it at an index below at, the target's
 * index in the segment (below 0 or from n on where the target lies in
 * another segment) [README: rank]. */
typedef void (*lm_segment_fn)(const void *z, const void *r, int64_t n, int flags,
                              double cap, double thr, int64_t at, const void *next,
                              const void *next_ref, lm_state *st);
/* Element k of z as the segment kernel's lanes see it: converted to the
 * lane type and, with cap > 0, capped by the lanes' own softcap. */
typedef double (*lm_value_fn)(const void *z, int64_t k, double cap);

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

/* A read-only pass for the benchmarks' speed limit: the max of n floats
 * (n a multiple of 128), prefetching ahead or not. */
typedef float (*lm_read_fn)(const float *p, int64_t n, int prefetch);

/* What each ISA unit exports: its segment kernels and lane values indexed
 * by dtype (NULL where the unit has none: the driver then runs the scalar
 * unit's) and its read pass. */
typedef struct {
    lm_segment_fn kernels[LM_NDTYPES];
    lm_value_fn values[LM_NDTYPES];
    lm_read_fn read;
} lm_unit;

extern const lm_unit lm_unit_scalar;
#ifdef LM_HAVE_AVX2
extern const lm_unit lm_unit_avx2;
#endif
#ifdef LM_HAVE_AVX512
extern const lm_unit lm_unit_avx512;
#endif
#ifdef LM_HAVE_NEON
extern const lm_unit lm_unit_neon;
#endif

#endif
