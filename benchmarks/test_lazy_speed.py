"""Lazy logits (lmmetrics.projected): a Llama-like head (d = 2048,
V = 128256) over a batch of positions, against the matmul alone and against
materialized logits followed by torch's cross-entropy; the peak memory of
each is measured in its own process by `lmmetrics bench --lazy`. Run with
    pytest benchmarks/test_lazy_speed.py --benchmark-only --benchmark-group-by=group
"""
import math

import pytest

import lmmetrics

torch = pytest.importorskip("torch")
N, D, V = 1024, 2048, 128256
GROUP = f"lazy-{N}x{D}x{V}-float32"


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, D, generator=g) / math.sqrt(D), torch.randn(V, D, generator=g) * 2.0,
            torch.randint(0, V, (N,), generator=g))


def _run(benchmark, fn):
    benchmark.group = GROUP
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=1)


def test_matmul_alone(benchmark, head):
    h, w, _ = head
    _run(benchmark, lambda: h @ w.T)


def test_materialized_then_cross_entropy(benchmark, head):
    h, w, t = head
    _run(benchmark, lambda: torch.nn.functional.cross_entropy(h @ w.T, t))


def test_lazy_evaluate(benchmark, head):
    h, w, t = head
    _run(benchmark, lambda: lmmetrics.evaluate(lmmetrics.projected(h, w), t))
