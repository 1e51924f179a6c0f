"""Speed of the one-pass extras: evaluate (NLL + entropy + accuracy) and
the NLL with each target's rank (top-k accuracy, reciprocal rank) against
cross_entropy alone, and KL over two buffers against a read-only pass over
both, with torch doing the same work. Same conventions as
test_kernel_speed.py; run with
    pytest benchmarks/test_metrics_speed.py --benchmark-only --benchmark-group-by=group
"""
import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from lmmetrics._bench_cpu import read_pass as fastest_read
from _bench import _run, workload

N, V = 2048, 128256
THREADS = _core.max_threads()
GROUP_EVAL = f"evaluate-{N}x{V}-float32"
GROUP_KL = f"kl-{N}x{V}-float32"


def _reference():
    z, _ = workload(N, V, "float32")
    return (z + np.random.default_rng(5).standard_normal(z.shape, dtype=np.float32) * 0.5)


def test_cross_entropy_sum(benchmark):
    z, t = workload(N, V, "float32")
    _run(benchmark, lambda: lmmetrics.cross_entropy(z, t, reduction="sum"), z.nbytes, GROUP_EVAL)


def test_evaluate(benchmark):
    z, t = workload(N, V, "float32")
    _run(benchmark, lambda: lmmetrics.evaluate(z, t), z.nbytes, GROUP_EVAL)


def test_nll_and_rank(benchmark):
    """The NLL and each target's rank in one pass (within 1.15x of the NLL
    alone on Zen 4, AVX-512)."""
    from lmmetrics import _engine

    z, t = workload(N, V, "float32")
    _run(benchmark, lambda: _engine.run(z, t, nll=True, rank=True), z.nbytes, GROUP_EVAL)


def test_torch_nll_and_rank(benchmark):
    torch = pytest.importorskip("torch")
    z, t = workload(N, V, "float32")
    zt, tt = torch.from_numpy(z), torch.from_numpy(t)
    torch.set_num_threads(THREADS)

    def work():
        nll = torch.nn.functional.cross_entropy(zt, tt, reduction="sum")
        rank = (zt > zt.gather(1, tt[:, None])).sum(1)
        return nll, rank

    _run(benchmark, work, z.nbytes, GROUP_EVAL)


def test_torch_nll_entropy_accuracy(benchmark):
    torch = pytest.importorskip("torch")
    z, t = workload(N, V, "float32")
    zt, tt = torch.from_numpy(z), torch.from_numpy(t)
    torch.set_num_threads(THREADS)

    def work():
        lp = torch.log_softmax(zt, -1)
        nll = -lp.gather(1, tt[:, None]).sum()
        ent = -(lp.exp() * lp).sum()
        acc = (zt.argmax(-1) == tt).sum()
        return nll, ent, acc

    _run(benchmark, work, z.nbytes, GROUP_EVAL)


def test_read_only_pass_one_buffer(benchmark):
    """The fastest read loop (as `lmmetrics bench` picks it)."""
    z, _ = workload(N, V, "float32")
    read, _ = fastest_read([z], THREADS, 2)
    _run(benchmark, read, z.nbytes, GROUP_EVAL)


@pytest.fixture(scope="module")
def pair():
    z, _ = workload(N, V, "float32")
    return _reference(), z


def test_kl_divergence(benchmark, pair):
    r, z = pair
    _run(benchmark, lambda: lmmetrics.kl_divergence(z, reference_logits=r, reduction="sum", num_threads=THREADS),
         2 * z.nbytes, GROUP_KL)


def test_read_only_pass_both_buffers(benchmark, pair):
    r, z = pair
    read, _ = fastest_read([z, r], THREADS, 2)
    _run(benchmark, read, 2 * z.nbytes, GROUP_KL)


def test_torch_kl_div(benchmark, pair):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    r, z = pair
    rt, zt = torch.from_numpy(r), torch.from_numpy(z)
    torch.set_num_threads(THREADS)
    _run(benchmark, lambda: F.kl_div(torch.log_softmax(zt, -1), torch.log_softmax(rt, -1), log_target=True,
                                     reduction="sum"), 2 * z.nbytes, GROUP_KL)
