"""A model against its base in another dtype (float32 base, bfloat16 / float16
model; float64 base, float32 model): every function that takes two logits
buffers reads each in its own dtype, a bounded chunk of rows at a time, and
agrees with float64 references computed from the values each buffer holds."""
import numpy as np
import pytest

import lmmetrics
from lmmetrics._engine import native as _native
from helpers import BF16, is_bf16, ref_kl
from test_compare import close, reference_stats
from test_evaluate import check_metrics, expected_metrics

torch = pytest.importorskip("torch")

_NO_BF16 = pytest.mark.skipif(BF16 is None, reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)")
PAIRS = [pytest.param((BF16, np.float32), marks=_NO_BF16, id="bfloat16-vs-float32"),
         pytest.param((np.float16, np.float32), id="float16-vs-float32"),
         pytest.param((np.float32, np.float64), id="float32-vs-float64"),
         pytest.param((BF16, np.float16), marks=_NO_BF16, id="bfloat16-vs-float16")]
TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
         np.dtype(np.float16): torch.float16}
if BF16 is not None:
    TORCH[BF16] = torch.bfloat16


def _pair(model_dtype, ref_dtype, shape=(3, 40), V=1001, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape + (V,)) * 3
    r = base.astype(ref_dtype)
    z = (base + rng.standard_normal(base.shape) * 0.3).astype(model_dtype)
    t = rng.integers(0, V, shape)
    t.reshape(-1)[::7] = -100
    return z, r, t


def _as(kind, x):
    if kind == "numpy":
        return x
    return torch.from_numpy(x.astype(np.float32)).to(TORCH[np.dtype(x.dtype)]) if is_bf16(x.dtype) \
        else torch.from_numpy(x)


@pytest.fixture(params=[None, 5 * 1001 * 8], ids=["one-chunk", "small-chunks"])
def chunks(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(_native, "MIXED_CHUNK_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtypes", PAIRS)
def test_mixed_dtypes_against_float64(dtypes, kind, chunks):
    z, r, t = _pair(*dtypes)
    zz, rr = _as(kind, z), _as(kind, r)
    z64, r64 = z.astype(np.float64), r.astype(np.float64)
    kl = lmmetrics.token_kl(zz, reference_logits=rr)
    np.testing.assert_allclose(np.asarray(kl), ref_kl(r64, z64), atol=2e-6, rtol=1e-6)
    assert lmmetrics.kl_divergence(zz, reference_logits=rr) == pytest.approx(ref_kl(r64, z64).mean(), rel=1e-6)
    check_metrics(lmmetrics.evaluate(zz, t, reference_logits=rr), expected_metrics(z, t, r=r))
    got, exp = lmmetrics.compare(zz, t, reference_logits=rr), reference_stats(r64, z64, t)
    assert got.tokens == exp["tokens"]
    for k in ("ppl", "ppl_ref", "ln_ratio", "same_top"):
        assert close(getattr(got, k).value, exp[k][0], abs=2e-6), k  # per-token values: 2e-6
    assert close(got.kld.mean.value, exp["kld"][0], abs=1e-7)
    assert close(got.delta_p.mean.value, exp["delta_p"][0], abs=1e-7)


def test_chunking_does_not_change_the_numbers(monkeypatch):
    z, r, t = _pair(BF16, np.float32, shape=(4, 33))
    view, rv = z[:, :-1], r[:, 1:]  # strided views on both sides
    one = lmmetrics.evaluate(view, t[:, :-1], reference_logits=rv)
    cmp_one = lmmetrics.compare(view, t[:, :-1], reference_logits=rv).as_dict()
    seen = []
    as_logits = _native.as_logits
    monkeypatch.setattr(_native, "as_logits", lambda *a: seen.append(as_logits(*a)) or seen[-1])
    monkeypatch.setattr(_native, "MIXED_CHUNK_BYTES", 7 * 1001 * 4)  # 7 rows
    assert lmmetrics.evaluate(view, t[:, :-1], reference_logits=rv) == one
    assert lmmetrics.compare(view, t[:, :-1], reference_logits=rv).as_dict() == cmp_one
    chunks = [x for x in seen if x.n_rows <= 7]
    assert chunks and all(x.dtype == "float32" for x in chunks)
    # the float32 reference is read in place: its chunks point into r
    lo, hi = r.ctypes.data, r.ctypes.data + r.nbytes
    assert sum(lo <= x.ptr < hi for x in chunks) == len(chunks) // 2


def test_evaluator_and_torch_views_mixed():
    z, r, t = _pair(np.float16, np.float32, shape=(2, 30))
    zt, rt = torch.from_numpy(z), torch.from_numpy(r)
    ev = lmmetrics.Evaluator()
    ev.update(zt[0], t[0], reference_logits=rt[0])
    ev.update(zt[1], t[1], reference_logits=rt[1])
    check_metrics(ev.compute(), expected_metrics(z, t, r=r))
    got = lmmetrics.token_kl(zt[:, 1:], reference_logits=rt[:, 1:])
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref_kl(r[:, 1:].astype(np.float64), z[:, 1:].astype(np.float64)),
                               atol=2e-6)


def test_mixed_dtype_errors_name_the_row():
    z, r, t = _pair(BF16, np.float32, shape=(3, 10))
    r[2, 4, 7] = np.nan
    with pytest.raises(ValueError, match=r"NaN in reference_logits at row 24 \(position \(2, 4\)\)"):
        lmmetrics.compare(z, t, reference_logits=r)
    t[1, 3] = 5000
    with pytest.raises(ValueError, match=r"target 5000 at position \(1, 3\)"):
        lmmetrics.evaluate(z, t, reference_logits=r)


def test_shift_applies_to_both_buffers():
    z, r, t = _pair(BF16, np.float32, shape=(2, 12))
    want = lmmetrics.compare(z[:, :-1], t[:, 1:], reference_logits=r[:, :-1]).as_dict()
    assert lmmetrics.compare(z, t, reference_logits=r, shift=True).as_dict() == want
    ev = lmmetrics.Evaluator(shift=True)
    ev.update(z, t, reference_logits=r)
    assert ev.compute() == lmmetrics.evaluate(z[:, :-1], t[:, 1:], reference_logits=r[:, :-1])
    with pytest.raises(TypeError, match="positional"):
        ev.update(z, t, r)  # the reference is keyword-only
