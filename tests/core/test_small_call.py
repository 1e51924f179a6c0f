"""The small call: cross_entropy / perplexity of plain arrays go from the
compiled binding to the core without the Python layer's per-row outputs
(``_engine.nll_total``), and a one-row job of 16K-64K elements is cut into
two segments that run on two threads. Both must give run()'s numbers and
errors exactly."""
import math

import numpy as np
import pytest
from helpers import ISAS, ref_entropy, ref_kl, ref_nll, ref_rank

import lmmetrics
from lmmetrics import _core, _engine


def _general_sum(logits, targets, **kw):
    """run()'s NLL sum and count: the general path"""
    res = _engine.run(logits, targets, nll=True, **kw)
    return res.nll_sum, res.n_counted


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape", [(7,), (1, 32000), (3, 5, 17), (40, 1000), (1, 70000)])
def test_plain_call_matches_the_general_path_bit_for_bit(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    t = rng.integers(0, shape[-1], shape[:-1])
    if t.ndim:
        t.reshape(-1)[1::3] = -100
    plain = _engine.nll_total(x, t, ignore_index=-100, shift=None, softcap=None, num_threads=None)
    assert plain is not None
    assert plain == _general_sum(x, t)
    ref = ref_nll(x, t)
    counted = (t != -100).sum()
    assert plain[1] == counted
    assert plain[0] == pytest.approx(ref.sum(), rel=2e-6)  # the per-token contract
    assert lmmetrics.cross_entropy(x, t, reduction="sum") == plain[0]
    assert lmmetrics.cross_entropy(x, t) == plain[0] / counted
    assert lmmetrics.perplexity(x, t) == math.exp(plain[0] / counted)


def test_torch_cpu_tensors_take_the_plain_call():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3000)).astype(np.float32)
    t = rng.integers(0, 3000, 4)
    xt = torch.from_numpy(x).requires_grad_(True)
    assert _engine.nll_total(xt, torch.from_numpy(t), ignore_index=-100, shift=None, softcap=None,
                             num_threads=None) == _general_sum(x, t)
    # bfloat16 has no numpy view; int32 targets are not the core's int64: run() takes them
    assert _engine.nll_total(xt.detach().bfloat16(), torch.from_numpy(t), ignore_index=-100, shift=None,
                             softcap=None, num_threads=None) is None
    assert _engine.nll_total(xt, torch.from_numpy(t).int(), ignore_index=-100, shift=None,
                             softcap=None, num_threads=None) is None
    assert lmmetrics.cross_entropy(xt, torch.from_numpy(t).int()) == pytest.approx(ref_nll(x, t).mean(), rel=1e-6)


def test_plain_call_is_taken_without_run(monkeypatch):
    x = np.zeros((2, 10), np.float32)
    t = np.array([1, 2])

    def no_run(*a, **k):
        raise AssertionError("the plain call went through run()")

    monkeypatch.setattr(_engine, "run", no_run)
    assert lmmetrics.cross_entropy(x, t) == pytest.approx(math.log(10), rel=1e-7)


@pytest.mark.parametrize("make", [
    lambda x: x[:, ::2],                                   # not contiguous
    lambda x: x.astype(x.dtype.newbyteorder(">")),         # big-endian
    lambda x: x[None, :0],                                 # no rows
])
def test_other_arrays_are_not_plain(make):
    x = make(np.zeros((3, 8), np.float32))
    t = np.zeros(x.shape[:-1], np.int64)
    assert _core.nll_total(x, t, -100, 0) is None


@pytest.mark.parametrize("targets", [np.array([0, 1], np.int32), np.array([0, 1], np.uint64),
                                     np.array([[0, 1]]), np.array([0, 1, 2])])
def test_targets_not_int64_of_the_leading_shape_are_not_plain(targets):
    assert _core.nll_total(np.zeros((2, 4), np.float32), targets, -100, 0) is None


def test_bad_rows_and_options_raise_run_s_errors():
    x = np.zeros((2, 8), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        lmmetrics.cross_entropy(x, np.array([0, 1]))
    assert _core.nll_total(x, np.array([0, 1]), -100, 0) is None   # the general path names the row
    with pytest.raises(ValueError, match="target"):
        lmmetrics.cross_entropy(np.zeros((2, 8), np.float32), np.array([0, 8]))
    with pytest.raises(ValueError, match="num_threads"):
        lmmetrics.cross_entropy(np.zeros((2, 8), np.float32), np.array([0, 1]), num_threads=0)
    with pytest.raises(TypeError, match="ignore_index"):
        lmmetrics.cross_entropy(np.zeros((2, 8), np.float32), np.array([0, 1]), ignore_index=1.5)
    with pytest.raises(TypeError, match="shift"):
        lmmetrics.cross_entropy(np.zeros((2, 8), np.float32), np.array([0, 1]), shift=0)
    with pytest.raises(ValueError, match="shape"):
        lmmetrics.cross_entropy(np.zeros((2, 8), np.float32), np.array([0, 1, 2]))
    # ignored rows are not read: the NaN row ignored is fine
    assert lmmetrics.cross_entropy(x, np.array([0, -100])) == pytest.approx(math.log(8), rel=1e-7)


def test_shift_true_and_softcap_take_the_general_path():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 50)).astype(np.float32)
    ids = rng.integers(0, 50, (2, 6))
    want = ref_nll(x[:, :-1], ids[:, 1:]).mean()
    assert lmmetrics.cross_entropy(x, ids, shift=True) == pytest.approx(want, rel=1e-6)
    capped = 5 * np.tanh(x.astype(np.float64) / 5)
    assert lmmetrics.cross_entropy(x, ids, shift=True, softcap=5.0) == pytest.approx(
        ref_nll(capped[:, :-1], ids[:, 1:]).mean(), rel=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("V", [16384, 32000, 50257, 65536])
def test_one_long_row_cut_in_two_halves(isa, dtype, V):
    """A one-row job of 16K-64K elements is two segments (two threads):
    every output is right, the argmax in the second half (and a tie across
    the halves: the first index), and the bits do not depend on the threads."""
    rng = np.random.default_rng(V)
    x = rng.standard_normal((1, V)).astype(dtype)
    r = rng.standard_normal((1, V)).astype(dtype)
    hi = V - 5                                 # the max in the second half
    x[0, hi] = 9
    t = np.array([V // 2 + 3])
    prev = _core.active_isa()
    _core.set_isa(isa)
    try:
        runs = [lmmetrics.evaluate(x, t, reference_logits=r, top_k=5, num_threads=k) for k in (1, 2)]
        a, b = (np.array(list(m.as_dict().values()), np.float64) for m in runs)
        assert np.array_equal(a, b, equal_nan=True)
        nll = [lmmetrics.token_nll(x, t, num_threads=k) for k in (1, 2)]
        assert np.array_equal(nll[0], nll[1])
        assert nll[0][0] == pytest.approx(ref_nll(x, t)[0], rel=2e-6)
        assert lmmetrics.token_entropy(x, num_threads=2)[0] == pytest.approx(ref_entropy(x)[0], rel=2e-6)
        assert lmmetrics.token_kl(x, reference_logits=r, num_threads=2)[0] == pytest.approx(
            ref_kl(r, x)[0], rel=1e-5)
        assert lmmetrics.token_rank(x, t, num_threads=2)[0] == ref_rank(x[:1], t[:1])[0]
        assert runs[0].accuracy == 0.0
        tie = x.copy()
        tie[0, 10] = 9                         # the same max in the first half: the first index wins
        got = lmmetrics.evaluate(tie, np.array([10]), num_threads=2, top_k=1)
        assert got.accuracy == got.top_k_accuracy[1] == 1.0
        # the rank breaks the tie across the halves as the argmax does
        assert [lmmetrics.token_rank(tie, np.array([k]), num_threads=2)[0] for k in (10, hi)] == [0, 1]
        assert lmmetrics.evaluate(tie, np.array([hi]), num_threads=2, top_k=1).top_k_accuracy[1] == 0.0
        assert lmmetrics.evaluate(x, np.array([hi]), num_threads=2).accuracy == 1.0
    finally:
        _core.set_isa(prev)
