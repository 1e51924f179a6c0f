/* Compiler portability: GCC, Clang (also clang-cl) and MSVC.
 *   LM_ALWAYS_INLINE        static, inlined even at -O0
 *   LM_NOINLINE             static, never inlined
 *   LM_PREFETCH(a)          prefetch address a (a pointer or a uintptr_t) for
 *                           reading, non-temporal where the compiler has the hint
 *                           (the logits are read once: on Zen 4 one thread kept up
 *                           with 0.93-0.96 of a read pass, against 0.83-0.91
 *                           prefetching into every level)
 *   LM_X86                  defined when the target is x86 / x86-64; then
 *   lm_cpuid(leaf, sub, r)  r = eax, ebx, ecx, edx of cpuid; 0 when the
 *                           CPU has no such leaf
 *   lm_xgetbv0()            XCR0 (call only when cpuid reports OSXSAVE)
 * MSVC proper gets its intrinsics (__forceinline, _mm_prefetch / __prefetch,
 * __cpuidex, _xgetbv); GCC and Clang their builtins, and xgetbv by its
 * bytes, which old assemblers (macOS) do not know by name. */
#ifndef LM_PORT_H
#define LM_PORT_H

#if defined(_MSC_VER) && !defined(__clang__)
#define LM_MSVC 1
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LM_ALWAYS_INLINE static inline __attribute__((always_inline))
#elif defined(LM_MSVC)
#define LM_ALWAYS_INLINE static __forceinline
#else
#define LM_ALWAYS_INLINE static inline
#endif

/* static, never inlined: a function compiled (and its registers allocated)
 * on its own */
#if defined(__GNUC__) || defined(__clang__)
#define LM_NOINLINE static __attribute__((noinline))
#elif defined(LM_MSVC)
#define LM_NOINLINE static __declspec(noinline)
#else
#define LM_NOINLINE static
#endif

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#define LM_X86 1
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LM_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 0)
#elif defined(LM_MSVC) && defined(LM_X86)
#include <xmmintrin.h>
#define LM_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_NTA)
#elif defined(LM_MSVC) && (defined(_M_ARM64) || defined(_M_ARM))
#include <intrin.h>
#define LM_PREFETCH(p) __prefetch((const void *)(p))
#else
#define LM_PREFETCH(p) ((void)(p))
#endif

/* the set bits of a 32-bit mask: one popcnt in a unit built with it (the
 * AVX-512 unit: -mpopcnt, and /arch:AVX512 implies it) */
#if defined(__GNUC__) || defined(__clang__)
#define LM_POPCNT32(m) __builtin_popcount((unsigned)(m))
#elif defined(LM_MSVC) && defined(LM_X86)
#include <intrin.h>
#define LM_POPCNT32(m) __popcnt((unsigned)(m))
#endif

#ifdef LM_X86
#ifdef LM_MSVC
#include <intrin.h>
#include <immintrin.h>
static inline int lm_cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    int v[4];
    __cpuid(v, (int)(leaf & 0x80000000u));
    if ((unsigned)v[0] < leaf) return 0;
    __cpuidex(v, (int)leaf, (int)sub);
    r[0] = (unsigned)v[0]; r[1] = (unsigned)v[1]; r[2] = (unsigned)v[2]; r[3] = (unsigned)v[3];
    return 1;
}
static inline unsigned long long lm_xgetbv0(void) { return _xgetbv(0); }
#else
#include <cpuid.h>
static inline int lm_cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    if ((unsigned)__get_cpuid_max(leaf & 0x80000000u, 0) < leaf) return 0;
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    return 1;
}
static inline unsigned long long lm_xgetbv0(void) {
    unsigned eax, edx;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0)); /* xgetbv */
    return ((unsigned long long)edx << 32) | eax;
}
#endif
#endif

#endif
