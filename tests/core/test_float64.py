"""float64 logits on every SIMD path against references in extended
precision (numpy's longdouble, x87's 64-bit mantissa where the platform has
it, mpmath for the closed forms): the float64 contract, per row within
F64_TOL (1 + |value|) for the NLL, entropy and KL, sums within F64_TOL
relative, the first argmax exact. The vector paths' double exp errs by
1.5e-15 relative a term, a bias that rows of equal terms add up (the flat
rows below) and the lane sums' roundings a few 1e-16 more; what is left
is float64's own rounding of the logits' differences."""
import math

import numpy as np
import pytest

mpmath = pytest.importorskip("mpmath")  # extended precision (installed with torch, or on its own)
import lmmetrics  # noqa: E402

F64_TOL = 1e-13  # as tests/properties/test_fuzz.py
LD = np.longdouble


def _lse(z):
    """log sum exp per row in longdouble"""
    z = np.asarray(z, LD)
    m = z.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]


def _log_probs(z):
    z = np.asarray(z, LD)
    return z - _lse(z)[..., None]


def _nll(z, t):
    lp = _log_probs(z)
    return -lp[np.arange(len(t)), t]


def _entropy(z):
    lp = _log_probs(z)
    return -(np.exp(lp) * lp).sum(-1)


def _kl(r, z):
    lr, lz = _log_probs(r), _log_probs(z)
    return (np.exp(lr) * (lr - lz)).sum(-1)


def _close(got, want, what):
    got, want = np.asarray(got, LD), np.asarray(want, LD)
    err = np.abs(got - want) / (1 + np.abs(want))
    assert float(err.max()) <= F64_TOL, (what, float(err.max()), int(err.argmax()))


def _rows(kind, n, v, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal((n, v)) * 3.0
    if kind == "near_uniform":  # a freshly initialised model: every r near 0
        return rng.standard_normal((n, v)) * 0.01
    if kind == "offset":  # large logits: the shift far from 0
        return rng.standard_normal((n, v)) * 5.0 + 1e4
    if kind == "wide":  # a spread past the clamp (e^-700)
        return rng.standard_normal((n, v)) * 300.0
    raise AssertionError(kind)


KINDS = ["normal", "near_uniform", "offset", "wide"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("v", [7, 1000, 32000, 128256])
def test_nll_entropy_argmax(isa, kind, v):
    n = 4 if v == 128256 else 16
    z = _rows(kind, n, v)
    t = np.random.default_rng(1).integers(0, v, n)
    _close(lmmetrics.token_nll(z, t), _nll(z, t), "nll")
    _close(lmmetrics.token_entropy(z), _entropy(z), "entropy")
    m = lmmetrics.evaluate(z, t)
    total = math.fsum(_nll(z, t).astype(np.float64).tolist())
    assert abs(m.nll_sum - total) <= F64_TOL * abs(total), (m.nll_sum, total)
    _argmax_is_first(z)


def _argmax_is_first(z):
    """the argmax the metrics use is the first index of the max: every row
    tied at two places (the max plus one), targets at the first and second"""
    n, v = z.shape
    if v < 3:
        return
    z = z.copy()
    first = np.random.default_rng(4).integers(0, v - 1, n)
    second = first + 1 + (np.arange(n) % (v - 1 - first))
    top = z.max(-1) + 1.0
    z[np.arange(n), first] = top
    z[np.arange(n), second] = top
    assert lmmetrics.evaluate(z, first).accuracy == 1.0
    assert lmmetrics.evaluate(z, second).accuracy == 0.0
    assert lmmetrics.evaluate(z[:, :-1], z[:, :-1].argmax(-1)).accuracy == 1.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("v", [7, 1000, 32000])
def test_kl(isa, kind, v):
    r = _rows(kind, 16, v, seed=2)
    z = r + np.random.default_rng(3).standard_normal(r.shape) * 0.5
    want = _kl(r, z)
    _close(lmmetrics.token_kl(z, reference_logits=r), want, "kl")
    got = lmmetrics.kl_divergence(z, reference_logits=r)
    assert abs(got - float(want.mean())) <= F64_TOL * (1 + float(want.mean()))


def test_summed_nll_of_a_batch(isa):
    """2048-wide batch of realistic rows: the sum within 1e-13 relative"""
    z = _rows("normal", 256, 50257, seed=5)
    t = np.random.default_rng(6).integers(0, 50257, 256)
    want = math.fsum(_nll(z, t).astype(np.float64).tolist())
    got = lmmetrics.cross_entropy(z, t, reduction="sum")
    assert abs(got - want) <= F64_TOL * abs(want), (got, want)


def _two_level_forms(x, v):
    """mpmath: NLL of target 0 and entropy of the row [0, x x (v - 1)]"""
    with mpmath.workdps(40):
        e = mpmath.exp(mpmath.mpf(x))
        s = 1 + (v - 1) * e
        p0, px = 1 / s, e / s
        return float(mpmath.log(s)), float(-(p0 * mpmath.log(p0) + (v - 1) * px * mpmath.log(px)))


@pytest.mark.parametrize("v", [2049, 32000, 128256])
def test_two_level_rows_swept(isa, v):
    """Flat rows, where every term carries the same error and the sums add
    them up: one logit at 0, the rest at x, x from -20 to 4."""
    xs = np.arange(-20.0, 4.0, {2049: 0.0625, 32000: 0.25, 128256: 1.0}[v]) + 1e-3
    z = np.repeat(xs[:, None], v, 1)
    z[:, 0] = 0.0
    nll = lmmetrics.token_nll(z, np.zeros(len(xs), np.int64))
    ent = lmmetrics.token_entropy(z)
    forms = [_two_level_forms(x, v) for x in xs]
    _close(nll, [f[0] for f in forms], "nll")
    _close(ent, [f[1] for f in forms], "entropy")


def test_kl_of_two_level_rows_swept(isa):
    a = np.arange(-12.0, 3.0, 0.25)
    ref = np.repeat(a[:, None], 2049, 1)
    ref[:, 0] = 0.0
    model = np.repeat((a[::-1] - 1.3)[:, None], 2049, 1)
    model[:, 0] = 0.0
    _close(lmmetrics.token_kl(model, reference_logits=ref), _kl(ref, model), "kl")


@pytest.mark.parametrize("v", [1, 2, 33, 32000])
def test_flat_rows_give_log_v(isa, v):
    """all-equal logits: every term is e^0 = 1 exactly, the NLL log V"""
    for c in (0.0, -3.25, 1e6):
        z = np.full((2, v), c)
        assert (lmmetrics.token_nll(z, np.array([0, v - 1])) == math.log(v)).all()
        assert abs(lmmetrics.token_entropy(z)[0] - math.log(v)) <= 1e-15 * (1 + math.log(v))


def test_special_values(isa):
    """-inf masks, +inf, a NaN, huge maxima (the exact path) as for float32"""
    v = 1000
    z = _rows("normal", 6, v, seed=7)
    z[0, ::3] = -np.inf
    z[1, 5] = np.inf
    z[2, 7] = 1e17  # beyond 2^50: the exact path
    z[3, :] = np.finfo(np.float64).min
    z[3, 9] = 0.0
    t = np.array([1, 5, 7, 9, 0, 0])
    got = lmmetrics.token_nll(z, t)
    finite = z.copy()
    finite[1] = np.where(np.isinf(z[1]), 0.0, -np.inf)  # +inf takes the mass
    _close(got[[0, 2, 3, 4, 5]], _nll(z[[0, 2, 3, 4, 5]], t[[0, 2, 3, 4, 5]]), "nll")
    assert got[1] == 0.0
    z[4, 11] = np.nan
    with pytest.raises(ValueError):
        lmmetrics.token_nll(z, t)
