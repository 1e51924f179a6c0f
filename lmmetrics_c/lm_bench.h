/* A benchmark entry point beside the product API of lm_kernel.h: the speed
 * limit the benchmarks compare the kernel with. */
#ifndef LM_BENCH_H
#define LM_BENCH_H

#include <stdint.h>

/* Reads nbytes at p once with an ISA's float max loop (isa as in
 * lm_kernel.h's lm_isa_* numbering, < 0: the active one; eight max chains,
 * prefetching ahead when prefetch is nonzero), in 64 KB chunks over
 * num_threads threads (<= 0: the OpenMP default); the bytes after the last
 * whole chunk are ORed. Returns a value that depends on every byte, so
 * that the read cannot be optimised away. An ISA this CPU or build lacks
 * reads with the portable loop. */
uint64_t lm_read_pass(const void *p, int64_t nbytes, int num_threads, int isa, int prefetch);

#endif
