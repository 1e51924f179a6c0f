"""Shared fixtures and the independent float64 reference the tests compare with."""
import numpy as np
import pytest
from scipy.special import log_softmax, logsumexp

from lmmetrics import _core

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])
ISAS = [i for i in _core.ISAS if _core.isa_supported(i)]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on every SIMD path this machine supports."""
    before = _core.active_isa()
    _core.set_isa(request.param)
    yield request.param
    _core.set_isa(before)


def ref_nll(logits, targets, ignore_index=-100):
    """Per-position NLL in float64 from the values the kernel saw (scipy)."""
    z = np.asarray(logits).astype(np.float64)
    t = np.asarray(targets)
    flat = z.reshape(-1, z.shape[-1])
    tf = t.reshape(-1)
    counted = (tf >= 0) & (tf != ignore_index)
    out = np.zeros(tf.shape, np.float64)
    rows = np.nonzero(counted)[0]
    if rows.size:
        lse = logsumexp(flat[rows], axis=1)
        out[rows] = lse - flat[rows, tf[rows]]
    return out.reshape(t.shape)


def random_logits(rng, shape, dtype, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@np.errstate(invalid="ignore")
def ref_entropy(z):
    """-sum p log p per row in float64 (0 log 0 = 0)."""
    lp = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lp)
    return -(np.where(p > 0, p * lp, 0.0)).sum(-1)


@np.errstate(invalid="ignore")
def ref_kl(r, z):
    """KL(softmax(r) || softmax(z)) per row in float64."""
    lr = log_softmax(np.asarray(r).astype(np.float64), axis=-1)
    lz = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lr)
    return np.where(p > 0, p * (lr - lz), 0.0).sum(-1)


# hypothesis profiles for the property suites (tests/test_fuzz.py; tests
# with their own @settings, as test_properties.py, keep their counts):
# "ci" (the default) runs up to 800 examples per property test: 3,200 fuzz
# cases (4 properties) + 800 shape-mismatch cases + the two small exception
# spaces exhausted (14 + 24), about a minute on 2 cores;
# HYPOTHESIS_PROFILE=long runs up to 5,000 per test: 20,000 fuzz cases +
# 5,000 shape-mismatch cases (+ the 38 exhaustive ones).
import os  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=800, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
