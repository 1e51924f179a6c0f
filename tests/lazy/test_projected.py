"""Lazy logits (lmmetrics.projected, lmmetrics.model_logits): every function
gives the materialized logits' numbers (computed here by numpy / torch from
the same hidden states and head, in float64 where the contract is tight),
never holds more than its chunk, never projects an ignored row, and names
what is wrong with bad input."""
import math

import numpy as np
import pytest

import lmmetrics
from lmmetrics._engine import lazy as _lazy
from helpers import assert_metrics_close, logsumexp, ref_entropy, ref_kl, ref_nll

TOL = 2e-6


def _case(rng, B=3, T=20, d=24, V=700, dtype=np.float32):
    h = rng.standard_normal((B, T, d)).astype(dtype)
    w = (rng.standard_normal((V, d)) * 0.4).astype(dtype)
    b = (rng.standard_normal(V) * 0.1).astype(dtype)
    ids = rng.integers(0, V, (B, T))
    ids[0, 3:6] = -100
    ids[2, -1] = -100
    return h, w, b, ids


def _logits64(h, w, b=None, scale=1.0, softcap=None):
    z = h.astype(np.float64) @ w.astype(np.float64).T
    if b is not None:
        z = z + b
    z = z * scale
    return z if softcap is None else softcap * np.tanh(z / softcap)


@pytest.fixture(params=[None, 5 * 700 * 4], ids=["one chunk", "chunks of 5 rows"])
def chunk(request):
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_function_matches_the_materialized_logits(chunk, dtype):
    rng = np.random.default_rng(1)
    h, w, b, ids = _case(rng, dtype=dtype)
    hr = h + rng.standard_normal(h.shape).astype(dtype) * 0.05
    lazy = lmmetrics.projected(h, w, b, chunk_bytes=chunk)
    lazy_ref = lmmetrics.projected(hr, w, b, chunk_bytes=chunk)
    z, r = (_logits64(x, w, b) for x in (h, hr))
    tgt = ids[:, 1:]
    zs, rs = z[:, :-1], r[:, :-1]
    counted = (tgt >= 0)
    want_nll = ref_nll(zs, tgt)
    tol = dict(rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lmmetrics.token_nll(lazy, ids, shift=True), want_nll, **tol)
    assert lmmetrics.cross_entropy(lazy, ids, shift=True) == pytest.approx(want_nll[counted].mean(), rel=1e-7)
    assert lmmetrics.cross_entropy(lazy, ids, shift=True, reduction="sum") == pytest.approx(want_nll.sum(), rel=1e-7)
    assert lmmetrics.perplexity(lazy, ids, shift=True) == pytest.approx(math.exp(want_nll[counted].mean()), rel=1e-6)
    assert lmmetrics.bits_per_token(lazy, ids, shift=True) == pytest.approx(
        want_nll[counted].mean() / math.log(2), rel=1e-7)
    table = rng.integers(0, 5, w.shape[0])
    nb = table[np.where(counted, tgt, 0)] * counted
    assert lmmetrics.bits_per_byte(lazy, ids, table, shift=True) == pytest.approx(
        (want_nll * (nb > 0)).sum() / (math.log(2) * nb.sum()), rel=1e-7)
    chars = table + 1
    nc = chars[np.where(counted, tgt, 0)] * counted
    assert lmmetrics.bits_per_character(lazy, ids, token_chars=chars, shift=True) == pytest.approx(
        want_nll.sum() / (math.log(2) * nc.sum()), rel=1e-7)
    np.testing.assert_allclose(lmmetrics.token_entropy(lazy), ref_entropy(z), **tol)
    np.testing.assert_allclose(lmmetrics.token_kl(lazy, reference_logits=lazy_ref), ref_kl(r, z), **tol)
    # the reference lazy, the model plain (and the other way round)
    np.testing.assert_allclose(lmmetrics.token_kl(z.astype(dtype), reference_logits=lazy_ref), ref_kl(r, z), **tol)
    assert lmmetrics.kl_divergence(lazy, reference_logits=r.astype(dtype)) == pytest.approx(
        ref_kl(r, z).mean(), rel=1e-6, abs=TOL)
    lp, greedy = lmmetrics.loglikelihood(lazy, ids, shift=True)
    np.testing.assert_allclose(lp, -want_nll.sum(1), rtol=1e-7)
    np.testing.assert_array_equal(greedy, [bool(((np.argmax(zs[i], -1) == tgt[i]) | ~counted[i]).all())
                                           for i in range(3)])
    # evaluate / Evaluator / compare, lazy against the same function on the
    # materialized logits (whose own contract the other tests hold)
    plain = lmmetrics.evaluate(h @ w.T + b, ids, shift=True, token_bytes=table, reference_logits=hr @ w.T + b)
    got = lmmetrics.evaluate(lazy, ids, shift=True, token_bytes=table, reference_logits=lazy_ref)
    assert_metrics_close(got.as_dict(), plain.as_dict(), rel=1e-6, abs=1e-6)
    assert got.entropy == pytest.approx(ref_entropy(zs)[counted].mean(), rel=1e-6)
    assert got.kl == pytest.approx(ref_kl(rs, zs)[counted].mean(), rel=1e-6, abs=TOL)
    ev = lmmetrics.Evaluator(shift=True, token_bytes=table)
    for i in range(3):
        ev.update(lmmetrics.projected(h[i], w, b, chunk_bytes=chunk), ids[i],
                  reference_logits=lmmetrics.projected(hr[i], w, b))
    # BLAS rounds per shape (and per CPU: OpenBLAS' Haswell kernels moved
    # loss_diff, a difference of two sums of 53 NLLs, by 1.1e-6 of itself)
    assert_metrics_close(ev.compute().as_dict(), got.as_dict(), rel=1e-6, abs=1e-8)
    c_plain = lmmetrics.compare(h @ w.T + b, ids, reference_logits=hr @ w.T + b, shift=True).as_dict()
    c_lazy = lmmetrics.compare(lazy, ids, reference_logits=lazy_ref, shift=True).as_dict()
    assert c_lazy["ppl"]["value"] == pytest.approx(c_plain["ppl"]["value"], rel=1e-6)
    assert c_lazy["kld"]["mean"] == pytest.approx(c_plain["kld"]["mean"], rel=1e-5, abs=1e-9)
    assert c_lazy["same_top"] == c_plain["same_top"]


def test_scale_softcap_unshifted_and_flat_rows():
    rng = np.random.default_rng(2)
    h, w, b, ids = _case(rng, T=9)
    z = _logits64(h, w, b, scale=3.0, softcap=7.0)
    lazy = lmmetrics.projected(h, w, b, scale=3.0, softcap=7.0, chunk_bytes=4 * 700 * 4)
    np.testing.assert_allclose(lmmetrics.token_nll(lazy, ids), ref_nll(z, ids), rtol=1e-5, atol=1e-5)
    # one position, one row (d,): shapes as plain logits have them
    one = lmmetrics.projected(h[0, 0], w)
    assert one.shape == (700,)
    assert lmmetrics.token_nll(one, ids[1, 0]) == pytest.approx(ref_nll(_logits64(h[0, 0], w), ids[1, 0]), abs=TOL)
    # a softcap on the call caps lazy logits as it caps plain ones
    plain = lmmetrics.token_nll(h @ w.T, ids, softcap=4.0)
    np.testing.assert_allclose(lmmetrics.token_nll(lmmetrics.projected(h, w), ids, softcap=4.0), plain,
                               rtol=1e-5, atol=1e-5)


def test_chunks_are_bounded_and_ignored_rows_never_projected(monkeypatch):
    rng = np.random.default_rng(3)
    h, w, b, ids = _case(rng, B=4, T=50)
    seen = []
    rows = _lazy.Projected.rows
    monkeypatch.setattr(_lazy.Projected, "rows", lambda self, idx, *cols: seen.append(
        (np.array(idx), rows(self, idx, *cols))) or seen[-1][1])
    flat = ids.reshape(-1)
    # a narrow vocabulary: whole rows, 7 at a time
    budget = 7 * 400 * 4
    lmmetrics.cross_entropy(lmmetrics.projected(h, w[:400], chunk_bytes=budget), np.where(ids >= 0, ids % 400, ids))
    assert max(z.nbytes for _, z in seen) <= budget and len(seen) > 10
    assert all(z.shape[1] == 400 for _, z in seen)
    done = np.concatenate([i for i, _ in seen])
    np.testing.assert_array_equal(np.sort(done), np.flatnonzero(flat >= 0))  # each counted row once
    # the default budget on the host: a few tens of MiB of logits, one chunk here
    seen.clear()
    lmmetrics.cross_entropy(lmmetrics.projected(h, w), ids)
    assert len(seen) == 1
    # a vocabulary too wide for the budget: tiles of rows x a vocabulary block
    hw, ww = rng.standard_normal((300, 8)).astype(np.float32), rng.standard_normal((5000, 8)).astype(np.float32)
    tw = rng.integers(0, 5000, 300)
    tw[::7] = -100
    seen.clear()
    budget = 600 * 4 * 40  # 40 rows x 600 columns
    m = lmmetrics.evaluate(lmmetrics.projected(hw, ww, chunk_bytes=budget), tw)
    assert max(z.nbytes for _, z in seen) <= budget and max(z.shape[1] for _, z in seen) < 5000
    assert not (set(np.concatenate([i for i, _ in seen])) & set(np.flatnonzero(tw < 0)))
    z = hw.astype(np.float64) @ ww.T.astype(np.float64)
    c = tw >= 0
    assert m.loss == pytest.approx(ref_nll(z[c], tw[c]).mean(), rel=1e-6)
    assert m.entropy == pytest.approx(ref_entropy(z[c]).mean(), rel=1e-6)
    assert m.accuracy == pytest.approx((np.argmax(z[c], 1) == tw[c]).mean())


def test_torch_tensors_and_16_bit():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    h, w, b, ids = _case(rng)
    ht, wt, bt, it = (torch.from_numpy(x) for x in (h, w, b, ids))
    lazy = lmmetrics.projected(ht, wt, bt, chunk_bytes=3 * 700 * 4)
    nll = lmmetrics.token_nll(lazy, it, shift=True)
    assert isinstance(nll, torch.Tensor) and nll.shape == (3, 19)
    np.testing.assert_allclose(nll.numpy(), ref_nll(_logits64(h, w, b)[:, :-1], ids[:, 1:]), rtol=1e-5, atol=1e-5)
    for dt in (torch.bfloat16, torch.float16):
        lz = lmmetrics.projected(ht.to(dt), wt.to(dt), bt.to(dt))
        full = torch.nn.functional.linear(ht.to(dt), wt.to(dt), bt.to(dt))
        assert lz.dtype == str(dt).replace("torch.", "")
        assert lmmetrics.perplexity(lz, it, shift=True) == pytest.approx(
            lmmetrics.perplexity(full, it, shift=True), rel=1e-3)


def test_bad_input_is_named():
    rng = np.random.default_rng(5)
    h, w, b, ids = _case(rng)
    with pytest.raises(ValueError, match=r"hidden size 24 .* does not match the weight's 23"):
        lmmetrics.projected(h, w[:, :23])
    with pytest.raises(ValueError, match=r"bias must have shape \(700,\)"):
        lmmetrics.projected(h, w, b[:5])
    with pytest.raises(TypeError, match="float32 or float64"):
        lmmetrics.projected(h.astype(np.float16), w)
    with pytest.raises(ValueError, match="scale"):
        lmmetrics.projected(h, w, scale=0.0)
    with pytest.raises(ValueError, match=r"vocabulary \(700\) and the reference's \(600\) differ"):
        lmmetrics.token_kl(lmmetrics.projected(h, w), reference_logits=lmmetrics.projected(h, w[:600]))
    with pytest.raises(ValueError, match="softcap is given both"):
        lmmetrics.token_nll(lmmetrics.projected(h, w, softcap=30.0), ids, softcap=30.0)
    with pytest.raises(ValueError, match="out of range"):
        lmmetrics.token_nll(lmmetrics.projected(h, w), np.full_like(ids, 700))
    # a NaN hidden state: the row named as in the input, not in its chunk
    h2 = h.copy()
    h2[2, 7, 0] = np.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 47 \(position \(2, 7\)\)"):
        lmmetrics.token_nll(lmmetrics.projected(h2, w, chunk_bytes=700 * 4 * 3), ids)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="all be torch tensors or all numpy"):
        lmmetrics.projected(torch.from_numpy(h), w)
    with pytest.raises(TypeError, match="share one dtype"):
        lmmetrics.projected(torch.from_numpy(h), torch.from_numpy(w).double())


def test_an_evaluator_keeps_its_sums_when_an_update_fails():
    rng = np.random.default_rng(6)
    h, w, b, ids = _case(rng)
    ev = lmmetrics.Evaluator()
    ev.update(lmmetrics.projected(h, w), ids)
    before = ev.compute().as_dict()
    h2 = h.copy()
    h2[1, 4, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ev.update(lmmetrics.projected(h2, w, chunk_bytes=700 * 4), ids)
    assert ev.compute().as_dict() == before


def test_vocabulary_blocks_merge_exactly():
    """Tiles of rows x vocabulary blocks (a budget far below a row): the
    merged NLL, entropy, KL, argmax (ties across blocks: the first) and the
    reference's NLL and argmax against float64; a reference block all -inf
    (the rows done again whole); NaN named at its row."""
    rng = np.random.default_rng(7)
    h = rng.standard_normal((2, 30, 6)).astype(np.float32)
    w = rng.standard_normal((2000, 6)).astype(np.float32)
    w[1500] = w[100]  # a tie across blocks: the first index wins
    h[0, 3] = w[100] * 4
    t = rng.integers(0, 2000, (2, 30))
    z = _logits64(h, w)
    r = z + rng.standard_normal(z.shape) * 0.3
    r[1, 5, :700] = -np.inf  # a block of the reference with no mass
    r[1, 5, 0] = 0.0
    r[1, 6, 600:1400] = -np.inf
    lazy = lmmetrics.projected(h, w, chunk_bytes=8 * 600 * 12)
    for cap in (None, 9.0):
        zc, rc = (x if cap is None else cap * np.tanh(x / cap) for x in (z, r))
        got = lmmetrics._engine.run(lazy, t, r.astype(np.float32), softcap=cap, nll=True, entropy=True, argmax=True,
                                    kl=True, ref_nll=True)
        tol = dict(rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.nll, ref_nll(zc, t).reshape(-1), **tol)
        np.testing.assert_allclose(got.entropy, ref_entropy(zc).reshape(-1), **tol)
        np.testing.assert_allclose(got.kl, ref_kl(rc, zc).reshape(-1), **tol)
        np.testing.assert_allclose(got.ref_nll, ref_nll(rc, t).reshape(-1), **tol)
        np.testing.assert_array_equal(got.argmax, np.argmax(z, -1).reshape(-1))
        np.testing.assert_array_equal(got.ref_argmax, np.argmax(r, -1).reshape(-1))
        assert got.argmax[3] == 100
    h[1, 20, 1] = np.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 50 \(position \(1, 20\)\)"):
        lmmetrics.token_nll(lmmetrics.projected(h, w, chunk_bytes=8 * 600 * 4), t)


def test_vocabulary_blocks_hold_one_tile_name_the_first_bad_row_and_take_any_reference():
    """Found by an adversarial review of the block path: the previous tile
    was still held while the next was computed (peak 2x chunk_bytes); a NaN
    of an earlier row in a later block was named after a later row's in an
    earlier block; the reference's own chunk_bytes was ignored; a list as
    the other side's logits crashed."""
    import tracemalloc

    rng = np.random.default_rng(4)
    h, w = rng.standard_normal((64, 8)).astype(np.float32), rng.standard_normal((20000, 8)).astype(np.float32)
    budget = 2**20
    lazy = lmmetrics.projected(h, w, chunk_bytes=budget)
    lmmetrics.token_nll(lazy, np.zeros(64, np.int64))  # (warm)
    tracemalloc.start()
    lmmetrics.token_nll(lazy, np.zeros(64, np.int64))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.5 * budget, peak / budget
    # NaN at row 2's column 900 (second block), row 5's column 100 (first)
    w2 = rng.standard_normal((1000, 4)).astype(np.float32) + 3.0
    w2[100, 0] = w2[900, 1] = 0.0
    h2 = rng.standard_normal((8, 4)).astype(np.float32)
    h2[5, 0] = h2[2, 1] = np.inf
    with np.errstate(invalid="ignore"):
        plain = h2 @ w2.T
    for x in (plain, lmmetrics.projected(h2, w2), lmmetrics.projected(h2, w2, chunk_bytes=8 * 512 * 4)):
        with pytest.raises(ValueError, match=r"NaN in logits at row 2 "):
            lmmetrics.token_nll(x, np.zeros(8, np.int64))
    # the smaller of the two sides' budgets
    seen = []
    rows = _lazy.Projected._rows
    h3, w3 = rng.standard_normal((256, 16)).astype(np.float32), rng.standard_normal((4000, 16)).astype(np.float32)
    try:
        _lazy.Projected._rows = lambda self, i, c: seen.append(rows(self, i, c).nbytes) or rows(self, i, c)
        for mc, rc in ((None, 64 << 10), (64 << 10, None)):
            seen.clear()
            lmmetrics.token_kl(lmmetrics.projected(h3, w3, chunk_bytes=mc),
                               reference_logits=lmmetrics.projected(h3 * 1.1, w3, chunk_bytes=rc))
            assert max(seen) <= 64 << 10, (mc, rc, max(seen))
    finally:
        _lazy.Projected._rows = rows
    # a list on the other side
    ref = (h3[:4] * 1.1 @ w3.T).astype(np.float64)
    want = ref_kl(ref, h3[:4].astype(np.float64) @ w3.T.astype(np.float64))
    np.testing.assert_allclose(lmmetrics.token_kl(lmmetrics.projected(h3[:4], w3), reference_logits=ref.tolist()),
                               want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(lmmetrics.token_kl((h3[:4] @ w3.T).tolist(),
                                                  reference_logits=lmmetrics.projected(h3[:4] * 1.1, w3)),
                               want, rtol=1e-4, atol=1e-6)


def _padded_vocabulary(rng, V=2000, pad=500):
    """Lazy logits whose last pad columns are masked by a -inf bias (padded
    vocabulary entries): the last vocabulary block all -inf, the one before
    partly, and token 0 (the first block's first column); a plain reference masked from column 1300 on (rows 3 and 9
    hold mass in the model's last block, which has none: KL inf), row 5's
    first block all -inf, a target in the padding (NLL inf)."""
    h = rng.standard_normal((2, 8, 6)).astype(np.float32)
    w = rng.standard_normal((V, 6)).astype(np.float32)
    b = np.zeros(V, np.float32)
    b[V - pad:] = -np.inf
    b[0] = -np.inf  # (a block's first column)
    t = rng.integers(0, V - pad, (2, 8))
    t[1, 2] = V - 1
    z = _logits64(h, w, b)
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    r[..., 1300:] = -np.inf
    r[0, 3, 1600:] = r[1, 1, 1600:] = 1.0
    r[0, 5, :600] = -np.inf
    return h, w, b, t, z, r


@pytest.mark.parametrize("route", ["host", "cuda path"])
def test_a_vocabulary_block_all_minus_inf_holds_no_mass(monkeypatch, route):
    """A -inf bias masking padded vocabulary entries leaves whole vocabulary
    blocks at -inf: such a block adds no mass, and no row is done again
    (every row of the chunk was, whole and one at a time: 4x the time at V
    8192, d 1024), on the host and on the CUDA path (CPU tensors routed
    through it); the numbers are the float64 reference's on the
    materialized logits."""
    from lmmetrics._engine import cuda as _cuda, inputs as _inputs
    from lmmetrics import _engine

    rng = np.random.default_rng(11)
    h, w, b, t, z, r = _padded_vocabulary(rng)
    calls = []
    rows = _lazy.Projected.rows
    monkeypatch.setattr(_lazy.Projected, "rows", lambda self, i, *cols: calls.append(cols) or rows(self, i, *cols))
    if route == "cuda path":
        torch = pytest.importorskip("torch")
        routed = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
        monkeypatch.setattr(_inputs, "is_cuda", routed)
        exact = _cuda.exact_rows
        monkeypatch.setattr(_cuda, "exact_rows", lambda idx, *a: calls.append("exact " + str(idx)) or exact(idx, *a))
        h, w, b, r = (torch.from_numpy(x) for x in (h, w, b, r))
    lazy = lmmetrics.projected(h, w, b, chunk_bytes=8 * 600 * 8)
    got = _engine.run(lazy, t, r, nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, top_logprob=True)
    assert calls and all(c and c[0] != slice(None) for c in calls)  # (whole rows: done again)
    assert "exact" not in str(calls)
    assert any(c[0].start >= 1500 for c in calls)  # (a block all -inf)
    tol = dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got.nll, ref_nll(z, t).reshape(-1), **tol)
    assert got.nll[8 + 2] == np.inf
    np.testing.assert_allclose(got.entropy, ref_entropy(z).reshape(-1), **tol)
    np.testing.assert_allclose(got.kl, ref_kl(r, z).reshape(-1), **tol)
    assert np.isinf(got.kl[[3, 9]]).all() and np.isfinite(np.delete(got.kl, [3, 9])).all()
    np.testing.assert_allclose(got.ref_nll, ref_nll(r, t).reshape(-1), **tol)
    np.testing.assert_allclose(got.top_logprob, (z.max(-1) - logsumexp(z, axis=-1)).reshape(-1), **tol)
    np.testing.assert_array_equal(got.argmax, np.argmax(z, -1).reshape(-1))
    np.testing.assert_array_equal(got.ref_argmax, np.argmax(np.asarray(r), -1).reshape(-1))


def test_plus_inf_in_a_vocabulary_block_gives_the_limits_without_a_warning():
    """A +inf logit in one vocabulary block, of the model and of a lazy
    reference: the row holds all the mass there (NLL 0 at that target, ln 2
    for two, inf elsewhere) and no RuntimeWarning is raised on the way, so
    that a run with warnings as errors does not fail on a valid input."""
    import warnings

    rng = np.random.default_rng(13)
    h = rng.standard_normal((4, 6)).astype(np.float32)
    w = (rng.standard_normal((2000, 6)) * 0.3).astype(np.float32)
    b = np.zeros(2000, np.float32)
    b[1500] = np.inf
    lazy = lmmetrics.projected(h, w, b, chunk_bytes=8 * 600 * 4)
    t = np.array([1500, 3, 1500, 700])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lmmetrics._engine.run(lazy, t, lazy, nll=True, entropy=True, kl=True, ref_nll=True)
        m = lmmetrics.evaluate(lazy, t, reference_logits=lazy)
    np.testing.assert_array_equal(got.nll, [0.0, np.inf, 0.0, np.inf])
    np.testing.assert_array_equal(got.ref_nll, got.nll)
    np.testing.assert_array_equal(got.entropy, 0.0)
    assert m.loss == np.inf and m.entropy == 0.0


def test_a_row_all_minus_inf_is_named_before_a_later_nan_with_blocks_all_minus_inf():
    """With blocks all -inf merged as no mass, a row all -inf (here the
    reference's) is still named, and before a later row's NaN whichever
    block holds it, as the native core names them on whole rows."""
    rng = np.random.default_rng(12)
    h, w, b, t, z, r = _padded_vocabulary(rng)
    lazy = lmmetrics.projected(h, w, b, chunk_bytes=8 * 600 * 8)
    r[0, 6] = -np.inf
    with pytest.raises(ValueError, match=r"reference_logits row 6 \(position \(0, 6\)\) is all -inf"):
        lmmetrics.token_kl(lazy, reference_logits=r)
    h2 = h.copy()
    h2[1, 0, 0] = np.nan  # row 8: NaN in every block, the first one first
    for ref, want in ((r, r"reference_logits row 6 .* all -inf"), (np.where(np.isinf(r), 0, r), "NaN in logits at row 8")):
        with pytest.raises(ValueError, match=want):
            lmmetrics.token_kl(lmmetrics.projected(h2, w, b, chunk_bytes=8 * 600 * 8), reference_logits=ref)


def test_projected_refuses_a_hidden_size_of_0_and_options_that_are_not_numbers():
    """A hidden size of 0 failed at the first metric with numpy's reshape
    message, and scale=True or scale='2' were taken as the numbers 1 and 2:
    each is refused when the lazy logits are built (as softcap and
    chunk_bytes are), naming what is wrong."""
    rng = np.random.default_rng(13)
    h, w, b, ids = _case(rng)
    with pytest.raises(ValueError, match=r"projected: hidden size 0 \(hidden shape \(3, 20, 0\), weight shape "
                                         r"\(700, 0\)\)"):
        lmmetrics.projected(h[..., :0], w[:, :0], b)
    for bad in (True, False, "2", None, [2.0]):
        with pytest.raises(TypeError, match=r"projected: scale must be a real number \(a float\), got "):
            lmmetrics.projected(h, w, scale=bad)
    for bad in (True, "2", [2.0]):
        with pytest.raises(TypeError, match="softcap must be a number or None"):
            lmmetrics.projected(h, w, softcap=bad)
    for bad in (True, "2", 2.5, 0):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
            lmmetrics.projected(h, w, chunk_bytes=bad)
    # numbers of any real type are numbers
    z = _logits64(h, w, b, scale=2.0)
    for scale in (2, np.float32(2.0), np.int64(2)):
        np.testing.assert_allclose(lmmetrics.token_nll(lmmetrics.projected(h, w, b, scale=scale), ids),
                                   ref_nll(z, ids), rtol=TOL, atol=TOL)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"projected: hidden size 0"):
        lmmetrics.projected(torch.zeros(2, 0), torch.zeros(5, 0))


def _log_softmax_exact(z):
    """log-softmax in float64 taken relative to each row's max (z - max is
    exact): the helpers' logsumexp, added back to a max of 1e17, rounds
    the log of the mass away as the merge did."""
    d = z - z.max(-1, keepdims=True)
    return d - np.log(np.exp(d).sum(-1, keepdims=True))


def _routed(monkeypatch, route):
    """What makes a numpy array an input of the route: numpy itself for the
    host, a CPU tensor taken through the CUDA path (its torch path) else."""
    if route == "host":
        return np.asarray
    torch = pytest.importorskip("torch")
    from lmmetrics._engine import inputs as _inputs

    monkeypatch.setattr(_inputs, "is_cuda", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    return torch.from_numpy


@pytest.mark.parametrize("route", ["host", "cuda path"])
def test_vocabulary_blocks_of_huge_logits_keep_their_ties(monkeypatch, route):
    """Found by an adversarial review of the block path: each block's
    logsumexp was held as one float64, its largest logit plus the log of
    its mass beyond it, which past 2**53 times that log is the logit alone:
    logits of 1e17 (three tied maxima, two in the first block, one in the
    second) gave an NLL of 0 and an entropy of ln 2 where both are ln 3. The
    numbers are float64's on the materialized logits (relative to each
    row's max), with a reference (its NLL, the KL) and without."""
    wrap = _routed(monkeypatch, route)
    V = 1024
    rows = np.arange(4)
    for big in (1e17, 1e30, -1e30):
        h = np.array([[big], [big], [1.0], [big]], np.float32)
        w = np.full((V, 1), 0.5, np.float32)
        w[[3, 100, 600]] = 1.0
        w[900] = 0.25
        t = np.array([600, 3, 5, 900])
        z = h.astype(np.float64) @ w.T.astype(np.float64)
        lz, lr = _log_softmax_exact(z), _log_softmax_exact(z[::-1])
        lazy = lmmetrics.projected(wrap(h), wrap(w), chunk_bytes=2 * 512 * 4)
        lazy_ref = lmmetrics.projected(wrap(h[::-1].copy()), wrap(w))
        got = lmmetrics._engine.run(lazy, t, lazy_ref, nll=True, entropy=True, top_logprob=True, kl=True,
                                    ref_nll=True)
        with np.errstate(invalid="ignore", over="ignore"):
            want = dict(nll=-lz[rows, t], entropy=-(np.exp(lz) * lz).sum(1), top_logprob=lz.max(1),
                        ref_nll=-lr[rows, t], kl=(np.exp(lr) * (lr - lz)).sum(1))
        for name, v in want.items():
            np.testing.assert_allclose(getattr(got, name), v, rtol=2e-6, atol=2e-6, err_msg=f"{name} {big}")
        if big > 0:
            assert got.nll[0] == pytest.approx(math.log(3))


@pytest.mark.parametrize("route", ["host", "cuda path"])
def test_a_rank_tied_across_vocabulary_blocks(monkeypatch, route):
    """Found by an adversarial review of the block path: the target's logit
    that earlier blocks are ranked against came from a matmul over the rows
    whose target lies in its block, which rounds otherwise than the tiles
    (1 row against many: numpy's BLAS), so a target tied with an earlier
    block's logit (a duplicate head row, as untrained tokens have) ranked
    one off. The ranks are those of the materialized logits (one matmul:
    the tie exact), by the rank's rule counted in numpy."""
    wrap = _routed(monkeypatch, route)
    rng = np.random.default_rng(0)
    h = rng.standard_normal((300, 64)).astype(np.float32)
    w = rng.standard_normal((2000, 64)).astype(np.float32)
    w[100] = w[1500]  # a duplicate head row: token 100's logit ties with token 1500's
    t = np.full(300, 1500)
    t[1::2] = rng.integers(0, 2000, 150)
    z = h @ w.T
    assert (z[:, 100] == z[:, 1500]).all()
    zt = z[np.arange(300), t][:, None]
    want = ((z > zt) | ((z == zt) & (np.arange(2000) < t[:, None]))).sum(1)
    for chunk in (None, 3 * 520 * 4):  # whole rows, and vocabulary blocks of 520
        got = lmmetrics.token_rank(lmmetrics.projected(wrap(h), wrap(w), chunk_bytes=chunk), wrap(t))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(chunk))
