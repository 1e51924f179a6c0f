"""The kernel's fused extras (entropy, argmax, KL against reference logits,
softcap), checked through the engine against float64 references. The public
API over them (token_entropy, token_kl, evaluate, ...) builds on these."""
import numpy as np
import pytest

from lmmetrics import _engine
from helpers import DTYPES, random_logits, ref_entropy, ref_kl, ref_nll


def _tol(dtype):
    return 1e-10 if dtype == np.float64 else 2e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 17, 33, 5000, 70001])
def test_entropy_argmax_kl(isa, dtype, V):
    rng = np.random.default_rng(V)
    z = random_logits(rng, (5, V), dtype)
    r = random_logits(rng, (5, V), dtype)
    t = rng.integers(0, V, 5)
    res = _engine.run(z, t, r, nll=True, entropy=True, argmax=True, kl=True)
    tol = _tol(dtype)
    np.testing.assert_allclose(res.nll, ref_nll(z, t), atol=tol, rtol=tol)
    np.testing.assert_allclose(res.entropy, ref_entropy(z), atol=tol, rtol=tol)
    np.testing.assert_allclose(res.kl, ref_kl(r, z), atol=tol, rtol=tol)
    z64, r64 = z.astype(np.float64), r.astype(np.float64)
    np.testing.assert_array_equal(res.argmax, z64.argmax(-1))
    np.testing.assert_array_equal(res.ref_argmax, r64.argmax(-1))


def test_argmax_ties_take_the_lowest_index(isa):
    z = np.zeros((3, 9000), np.float32)
    z[0, [5, 7000]] = 3.0
    z[1, [8999, 4096]] = 2.0
    res = _engine.run(z, argmax=True)
    assert res.argmax.tolist() == [5, 4096, 0]


def test_masked_vocabulary_in_entropy_and_kl(isa):
    rng = np.random.default_rng(3)
    z = random_logits(rng, (4, 300), np.float32)
    r = random_logits(rng, (4, 300), np.float32)
    z[:, ::4] = -np.inf
    r[:, ::4] = -np.inf  # both masked: 0 * -inf terms are 0
    res = _engine.run(z, None, r, entropy=True, kl=True)
    np.testing.assert_allclose(res.entropy, ref_entropy(z), atol=2e-6)
    np.testing.assert_allclose(res.kl, ref_kl(r, z), atol=2e-6, rtol=1e-6)
    z[0, 1] = -np.inf  # the reference puts mass where the model has none
    assert _engine.run(z, None, r, kl=True).kl[0] == np.inf


def test_nan_in_reference_is_an_error(isa):
    z = np.zeros((2, 50), np.float32)
    r = np.zeros((2, 50), np.float32)
    r[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN in reference_logits at row 1"):
        _engine.run(z, None, r, kl=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap(isa, dtype):
    rng = np.random.default_rng(4)
    z = random_logits(rng, (6, 3000), dtype, scale=20.0)
    z[0, :5] = [0.0, 1e-4, -1e-4, 60.0, -np.inf]
    t = rng.integers(0, 3000, 6)
    c = 15.0
    capped = c * np.tanh(z.astype(np.float64) / c)
    res = _engine.run(z, t, softcap=c, nll=True, entropy=True, argmax=True)
    np.testing.assert_allclose(res.nll, ref_nll(capped, t), atol=2e-6)
    np.testing.assert_allclose(res.entropy, ref_entropy(capped), atol=2e-6)
    np.testing.assert_array_equal(res.argmax, capped.argmax(-1))
