"""Rows where many logits share one value (a flat row, a freshly initialised
model's): there the kernel's rounding errors add up instead of averaging
out, so each SIMD path is checked against closed forms in float64.

Found by an adversarial search: float lane sums of 128 equal terms were off
by 2.4e-6 in the NLL, 1.8e-5 in the entropy, 9e-6 in KL; a quadratic exp
with its error concentrated near r = 0 put all-zero logits on the AVX2 path
2e-8 relative from log V."""
import math

import numpy as np
import pytest

import lmmetrics

V = 2049  # one logit at 0, 2048 sharing the value x


def _two_level(x: float, v: int = V) -> np.ndarray:
    z = np.full((1, v), np.float32(x), np.float32)
    z[0, 0] = 0.0
    return z


@pytest.mark.parametrize("x", [-2.7388875, -1.3255875, -0.3, -5.726, -5.9852, 0.7, 3.1])
def test_nll_and_entropy_of_a_two_level_row(isa, x):
    xf = float(np.float32(x))
    z = _two_level(xf)
    s = 1.0 + (V - 1) * math.exp(xf)  # sum exp(z), float64
    nll0 = math.log(s)  # target 0: logit 0
    p0, px = 1.0 / s, math.exp(xf) / s
    entropy = -(p0 * math.log(p0) + (V - 1) * px * math.log(px))
    got = lmmetrics.cross_entropy(z, np.array([0], np.int64), reduction="sum")
    assert abs(got - nll0) <= 2e-6
    ent = float(lmmetrics.token_entropy(z)[0])
    assert abs(ent - entropy) <= 2e-6
    rep = np.repeat(z, 200, 0)
    total = lmmetrics.cross_entropy(rep, np.zeros(200, np.int64), reduction="sum")
    # float's own rounding of equal terms is systematic: 3e-8 of the sum at most
    assert abs(total - 200 * nll0) <= 5e-8 * 200 * nll0


@pytest.mark.parametrize("a,b", [(-0.08, -3.885), (-0.26, -3.51), (-1.0, 0.5)])
def test_kl_of_two_level_rows(isa, a, b):
    ref, model = _two_level(a), _two_level(b)
    lr = ref.astype(np.float64) - np.logaddexp.reduce(ref.astype(np.float64), axis=-1, keepdims=True)
    lm = model.astype(np.float64) - np.logaddexp.reduce(model.astype(np.float64), axis=-1, keepdims=True)
    want = float(np.sum(np.exp(lr) * (lr - lm)))
    got = float(lmmetrics.token_kl(model, reference_logits=ref)[0])
    assert abs(got - want) <= 2e-6


@pytest.mark.parametrize("v", [32000, 128256])
def test_all_zero_logits_give_log_vocab(isa, v):
    z = np.zeros((4, v), np.float32)
    got = lmmetrics.cross_entropy(z, np.arange(4, dtype=np.int64))
    assert got == pytest.approx(math.log(v), rel=1e-12)
    assert lmmetrics.perplexity(z, np.arange(4, dtype=np.int64)) == pytest.approx(v, rel=1e-10)


def test_near_uniform_logits_summed_nll(isa):
    """A fresh model's logits: N(0, 0.01^2), every r of the exp near 0."""
    rng = np.random.default_rng(2)
    n, v = 24, 128256
    z = (rng.standard_normal((n, v), dtype=np.float32) * np.float32(0.01)).astype(np.float32)
    t = rng.integers(0, v, n)
    z64 = z.astype(np.float64)
    m = z64.max(axis=1)
    lse = m + np.log(np.exp(z64 - m[:, None]).sum(axis=1))
    want = math.fsum(lse - z64[np.arange(n), t])
    got = lmmetrics.cross_entropy(z, t, reduction="sum")
    assert abs(got - want) <= 1e-8 * want


@pytest.mark.xfail(reason="known: the lane holding the max's term rounds its 15 equal neighbours the same way "
                          "(lmmetrics_c/README.md, Accuracy budget); up to 4.5e-6 in entropy", strict=False)
def test_entropy_of_a_wide_two_level_row_known_gap(isa):
    xf = float(np.float32(-9.241))
    v = 32000
    z = _two_level(xf, v)
    s = 1.0 + (v - 1) * math.exp(xf)
    p0, px = 1.0 / s, math.exp(xf) / s
    entropy = -(p0 * math.log(p0) + (v - 1) * px * math.log(px))
    assert abs(float(lmmetrics.token_entropy(z)[0]) - entropy) <= 2e-6
