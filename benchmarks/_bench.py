"""Shared by the benchmark suites: cached synthetic logits and one timing helper."""
import numpy as np
import pytest


def _logits(n, v, dtype):
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((n, v), dtype=np.float32) * 3)
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return z.astype(ml_dtypes.bfloat16)
    return z.astype(dtype)


_CACHE = {}


def workload(n, v, dtype):
    key = (n, v, dtype)
    if key not in _CACHE:
        _CACHE.clear()  # keep one large buffer alive at a time
        _CACHE[key] = (_logits(n, v, dtype), np.random.default_rng(1).integers(0, v, n))
    return _CACHE[key]


def _run(benchmark, fn, nbytes, group):
    benchmark.group = group
    benchmark.extra_info["GB/s"] = None
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable (a smoke run)
        benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.min / 1e9, 2)
