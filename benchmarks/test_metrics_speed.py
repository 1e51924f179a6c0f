"""Speed of the one-pass extras in every dtype: evaluate (NLL + entropy +
accuracy) and the NLL with each target's rank (top-k accuracy, reciprocal
rank) against cross_entropy alone, and KL over two buffers against a
read-only pass over both, with torch doing the same work; and the small
call (one row of 32000 float32 logits). Same conventions as
test_kernel_speed.py; run with
    pytest benchmarks/test_metrics_speed.py --benchmark-only --benchmark-group-by=group
"""
import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from lmmetrics.cli.bench.cpu import read_pass as fastest_read
from _bench import _logits, _run, workload

N, V = 2048, 128256
THREADS = _core.max_threads()
DTYPES = ["float32", "bfloat16", "float16", "float64"]
dtypes = pytest.mark.parametrize("dtype", DTYPES)


def _group(what, dtype):
    return f"{what}-{N}x{V}-{dtype}"


def _torch_dtype(torch, dtype):
    return getattr(torch, dtype)


def _pair(dtype):
    """(reference, model) logits of one dtype: the model's perturbed"""
    z, _ = workload(N, V, dtype)
    noise = np.random.default_rng(5).standard_normal(z.shape, dtype=np.float32) * 0.5
    return (z.astype(np.float32) + noise).astype(z.dtype), z


@dtypes
def test_cross_entropy_sum(benchmark, dtype):
    z, t = workload(N, V, dtype)
    _run(benchmark, lambda: lmmetrics.cross_entropy(z, t, reduction="sum"), z.nbytes, _group("evaluate", dtype))


@dtypes
def test_evaluate(benchmark, dtype):
    z, t = workload(N, V, dtype)
    _run(benchmark, lambda: lmmetrics.evaluate(z, t), z.nbytes, _group("evaluate", dtype))


@dtypes
def test_nll_and_rank(benchmark, dtype):
    """The NLL and each target's rank in one pass (within 1.15x of the NLL
    alone on Zen 4, AVX-512)."""
    from lmmetrics import _engine

    z, t = workload(N, V, dtype)
    _run(benchmark, lambda: _engine.run(z, t, nll=True, rank=True), z.nbytes, _group("evaluate", dtype))


@dtypes
def test_torch_nll_and_rank(benchmark, dtype):
    torch = pytest.importorskip("torch")
    zt, tt = _torch_workload(torch, dtype)
    torch.set_num_threads(THREADS)

    def work():
        nll = torch.nn.functional.cross_entropy(zt, tt, reduction="sum")
        rank = (zt > zt.gather(1, tt[:, None])).sum(1)
        return nll, rank

    _run(benchmark, work, zt.nbytes, _group("evaluate", dtype))


def _torch_workload(torch, dtype):
    z, t = workload(N, V, dtype)
    zt = torch.from_numpy(z.astype(np.float32)).to(_torch_dtype(torch, dtype)) if dtype == "bfloat16" \
        else torch.from_numpy(z)
    return zt, torch.from_numpy(t)


@dtypes
def test_torch_nll_entropy_accuracy(benchmark, dtype):
    torch = pytest.importorskip("torch")
    zt, tt = _torch_workload(torch, dtype)
    torch.set_num_threads(THREADS)

    def work():
        lp = torch.log_softmax(zt, -1)
        nll = -lp.gather(1, tt[:, None]).sum()
        ent = -(lp.exp() * lp).sum()
        acc = (zt.argmax(-1) == tt).sum()
        return nll, ent, acc

    _run(benchmark, work, zt.nbytes, _group("evaluate", dtype))


@dtypes
def test_read_only_pass_one_buffer(benchmark, dtype):
    """The fastest read loop (as `lmmetrics bench` picks it)."""
    z, _ = workload(N, V, dtype)
    read, _ = fastest_read([z], THREADS, 2)
    _run(benchmark, read, z.nbytes, _group("evaluate", dtype))


@dtypes
def test_kl_divergence(benchmark, dtype):
    r, z = _pair(dtype)
    _run(benchmark, lambda: lmmetrics.kl_divergence(z, reference_logits=r, reduction="sum", num_threads=THREADS),
         2 * z.nbytes, _group("kl", dtype))


@dtypes
def test_read_only_pass_both_buffers(benchmark, dtype):
    r, z = _pair(dtype)
    read, _ = fastest_read([z, r], THREADS, 2)
    _run(benchmark, read, 2 * z.nbytes, _group("kl", dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_kl_div(benchmark, dtype):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    r, z = _pair(dtype)
    rt, zt = torch.from_numpy(r), torch.from_numpy(z)
    torch.set_num_threads(THREADS)
    _run(benchmark, lambda: F.kl_div(torch.log_softmax(zt, -1), torch.log_softmax(rt, -1), log_target=True,
                                     reduction="sum"), 2 * z.nbytes, _group("kl", dtype))


SMALL = "small-call-1x32000-float32"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_small_call(benchmark, kind):
    """cross_entropy on one row (the fixed cost of a call), numpy or torch in"""
    z, t = _logits(1, 32000, "float32"), np.array([7])
    if kind == "torch":
        torch = pytest.importorskip("torch")
        z, t = torch.from_numpy(z), torch.from_numpy(t)
    benchmark.group = SMALL
    benchmark(lambda: lmmetrics.cross_entropy(z, t))


def test_torch_small_call(benchmark):
    torch = pytest.importorskip("torch")
    z, t = torch.from_numpy(_logits(1, 32000, "float32")), torch.tensor([7])
    benchmark.group = SMALL
    benchmark(lambda: torch.nn.functional.cross_entropy(z, t))
