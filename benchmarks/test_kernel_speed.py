"""Speed of the fused kernel against a read-only pass, torch and scipy.

Not part of the test run (testpaths = tests). Run with
    pytest benchmarks --benchmark-only --benchmark-group-by=group
Each workload is one group; GB/s is in extra_info. Compare within a group:
the machine's speed drifts, ratios measured in one run do not.
"""
import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from _bench import _run, workload

WORKLOADS = [(2048, 128256), (4096, 50257), (8, 32000)]
DTYPES = ["float32", "bfloat16", "float16", "float64"]
THREADS = _core.max_threads()


CASES = [(n, v, d) for (n, v) in WORKLOADS for d in DTYPES]
IDS = [f"{n}x{v}-{d}" for n, v, d in CASES]


@pytest.mark.parametrize("n,v,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("threads", [1, THREADS], ids=["1thread", "allthreads"])
def test_lmmetrics(benchmark, n, v, dtype, threads):
    z, t = workload(n, v, dtype)
    _run(benchmark, lambda: lmmetrics.cross_entropy(z, t, reduction="sum", num_threads=threads),
         z.nbytes, f"{n}x{v}-{dtype}")


READS = [(isa, pf) for isa in _core.ISAS if _core.isa_supported(isa) for pf in (False, True)]


@pytest.mark.parametrize("n,v,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("threads", [1, THREADS], ids=["1thread", "allthreads"])
@pytest.mark.parametrize("isa,prefetch", READS, ids=[f"{i}{'-prefetch' if p else ''}" for i, p in READS])
def test_read_only_pass(benchmark, n, v, dtype, threads, isa, prefetch):
    """Each SIMD path's read loop, plain and prefetching: the fastest is the
    speed limit (as in `lmmetrics bench`)."""
    z, _ = workload(n, v, dtype)
    ptr = z.__array_interface__["data"][0]
    _run(benchmark, lambda: _core.read_pass(ptr, z.nbytes, threads, isa, prefetch), z.nbytes,
         f"{n}x{v}-{dtype}")


@pytest.mark.parametrize("n,v,dtype", CASES, ids=IDS)
def test_torch(benchmark, n, v, dtype):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    z, t = workload(n, v, dtype)
    zt = torch.from_numpy(z.view(np.uint16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(z)
    tt = torch.from_numpy(t)
    torch.set_num_threads(THREADS)
    _run(benchmark, lambda: F.cross_entropy(zt, tt, reduction="sum"), z.nbytes, f"{n}x{v}-{dtype}")


_COMPILED = {}


@pytest.mark.parametrize("n,v,dtype", CASES, ids=IDS)
def test_torch_compile(benchmark, n, v, dtype):
    """torch.compile of the same F.cross_entropy (Inductor's C++ code on the
    CPU); compiled once per shape and dtype, outside the timing."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "compile"):
        pytest.skip("torch has no torch.compile")
    F = torch.nn.functional
    z, t = workload(n, v, dtype)
    zt = torch.from_numpy(z.view(np.uint16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(z)
    tt = torch.from_numpy(t)
    torch.set_num_threads(THREADS)
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(lambda a, b: F.cross_entropy(a, b, reduction="sum"))
    fn = _COMPILED["fn"]
    fn(zt, tt)
    _run(benchmark, lambda: fn(zt, tt), z.nbytes, f"{n}x{v}-{dtype}")


@pytest.mark.parametrize("n,v,dtype", [c for c in CASES if c[2] == "float32"],
                         ids=[i for i, c in zip(IDS, CASES) if c[2] == "float32"])
def test_scipy_logsumexp(benchmark, n, v, dtype):
    special = pytest.importorskip("scipy.special")
    z, t = workload(n, v, dtype)
    _run(benchmark, lambda: float((special.logsumexp(z, axis=1) - z[np.arange(n), t]).sum()),
         z.nbytes, f"{n}x{v}-{dtype}")
