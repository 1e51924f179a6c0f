"""Properties that hold for any input (hypothesis)."""
import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

import lmmetrics  # noqa: E402
from helpers import ref_nll  # noqa: E402

finite = st.floats(-50, 50, width=32)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    v = draw(st.integers(1, 70))
    z = draw(arrays(np.float32, (n, v), elements=finite))
    t = draw(arrays(np.int64, (n,), elements=st.integers(-3, v - 1)))
    return z, t


@settings(max_examples=150, deadline=None)
@given(batches())
def test_matches_reference_and_is_non_negative(batch):
    z, t = batch
    got = lmmetrics.token_nll(z, t)
    assert (got >= 0).all()
    np.testing.assert_allclose(got, ref_nll(z, t), atol=2e-6, rtol=1e-6)


@settings(max_examples=100, deadline=None)
@given(batches(), st.floats(-20, 20))
def test_shift_invariance(batch, c):
    z, t = batch
    a = lmmetrics.token_nll(z.astype(np.float64), t)
    b = lmmetrics.token_nll(z.astype(np.float64) + c, t)
    np.testing.assert_allclose(a, b, atol=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300))
def test_uniform_logits_give_log_v(v):
    z = np.zeros((2, v), np.float32)
    assert abs(lmmetrics.cross_entropy(z, np.array([0, v - 1])) - math.log(v)) < 2e-6
    assert abs(lmmetrics.perplexity(z, np.array([0, v - 1])) - v) < 1e-5 * v
