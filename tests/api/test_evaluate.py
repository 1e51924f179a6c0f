"""token_entropy, token_kl, kl_divergence, evaluate and Evaluator against
independent float64 computations (numpy / scipy)."""
import copy
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import DTYPES, random_logits, ref_entropy, ref_kl, ref_nll

LN2 = math.log(2.0)


def _data(seed, shape=(3, 40), V=3001, dtype=np.float32, ignore=True):
    rng = np.random.default_rng(seed)
    z = random_logits(rng, shape + (V,), dtype)
    r = (z.astype(np.float64) + rng.standard_normal(z.shape) * 0.5).astype(dtype)
    t = rng.integers(0, V, shape)
    if ignore:
        t.reshape(-1)[::7] = -100
    tb = rng.integers(0, 6, V)
    tb[:3] = 0  # special tokens
    return z, r, t, tb


def expected_metrics(z, t, tb=None, r=None, ignore_index=-100):
    """Every Metrics field from float64 numpy, written from the definitions."""
    z64 = np.asarray(z).astype(np.float64).reshape(-1, z.shape[-1])
    tf = np.asarray(t).reshape(-1)
    c = (tf >= 0) & (tf != ignore_index)
    nll = ref_nll(z64, tf, ignore_index)[c]
    n = int(c.sum())
    out = dict(tokens=n, ignored=int((~c).sum()), nll_sum=nll.sum(), loss=nll.mean())
    out["perplexity"] = math.exp(out["loss"])
    out["bits_per_token"] = out["loss"] / LN2
    out["accuracy"] = float(np.mean(z64[c].argmax(-1) == tf[c]))
    out["entropy"] = ref_entropy(z64[c]).mean()
    if tb is not None:
        b = np.asarray(tb)[tf[c]]
        out["bytes"] = int(b.sum())
        out["bits_per_byte"] = nll[b > 0].sum() / (LN2 * b.sum()) if b.sum() else math.inf
    if r is not None:
        r64 = np.asarray(r).astype(np.float64).reshape(-1, z.shape[-1])
        out["kl"] = ref_kl(r64[c], z64[c]).mean()
        out["same_top"] = float(np.mean(z64[c].argmax(-1) == r64[c].argmax(-1)))
    return out


def check_metrics(m, exp, rel=1e-6):
    for k, v in exp.items():
        got = getattr(m, k)
        if isinstance(v, int):
            assert got == v, k
        else:
            assert got == pytest.approx(v, rel=rel, abs=2e-6), k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_entropy(isa, dtype):
    z, _, _, _ = _data(1, dtype=dtype)
    z[0, 0, ::3] = -np.inf  # masked vocabulary: 0 * -inf terms are 0
    got = lmmetrics.token_entropy(z)
    assert got.shape == z.shape[:-1]
    np.testing.assert_allclose(got, ref_entropy(z), atol=2e-6, rtol=2e-6)


def test_token_entropy_limits():
    V = 1000
    uniform = np.zeros((1, V), np.float32)
    onehot = np.full((1, V), -np.inf, np.float32)
    onehot[0, 3] = 0.0
    assert lmmetrics.token_entropy(uniform)[0] == pytest.approx(math.log(V), rel=1e-6)
    assert lmmetrics.token_entropy(onehot)[0] == pytest.approx(0.0, abs=1e-12)


def test_token_kl_float32_within_2e6_of_float64(isa):
    rng = np.random.default_rng(2)
    V = 128256
    for scale, noise in [(3.0, 0.1), (3.0, 3.0), (8.0, 8.0)]:
        z = (rng.standard_normal((4, V)) * scale).astype(np.float32)
        r = (z + rng.standard_normal((4, V)) * noise).astype(np.float32)
        got = lmmetrics.token_kl(z, reference_logits=r)
        np.testing.assert_allclose(got, ref_kl(r, z), atol=2e-6, rtol=0)


def test_token_kl_properties(isa):
    z, r, _, _ = _data(3)
    assert np.all(lmmetrics.token_kl(z, reference_logits=z) < 1e-6)  # KL(p || p) = 0
    assert np.all(lmmetrics.token_kl(z, reference_logits=r) >= 0)
    # masked vocabulary on both sides; then the reference gives mass the model rules out
    z2, r2 = z.copy(), r.copy()
    z2[..., ::5] = -np.inf
    r2[..., ::5] = -np.inf
    np.testing.assert_allclose(lmmetrics.token_kl(z2, reference_logits=r2), ref_kl(r2, z2), atol=2e-6)
    z2[0, 0, 1] = -np.inf
    assert lmmetrics.token_kl(z2, reference_logits=r2)[0, 0] == np.inf


def test_kl_divergence_reductions():
    z, r, _, _ = _data(4)
    per = ref_kl(r, z)
    assert lmmetrics.kl_divergence(z, reference_logits=r) == pytest.approx(per.mean(), rel=1e-6)
    assert lmmetrics.kl_divergence(z, reference_logits=r, reduction="sum") == pytest.approx(per.sum(), rel=1e-6)
    np.testing.assert_allclose(lmmetrics.kl_divergence(z, reference_logits=r, reduction="none"), per, atol=2e-6)
    with pytest.raises(ValueError, match="reduction"):
        lmmetrics.kl_divergence(z, reference_logits=r, reduction="batchmean")


def test_kl_input_errors():
    z, r, _, _ = _data(5)
    with pytest.raises(ValueError, match="shape"):
        lmmetrics.token_kl(z, reference_logits=r[:, :-1])
    with pytest.raises(TypeError, match="positional"):
        lmmetrics.token_kl(r, z)  # the reference is keyword-only: never swapped silently
    r[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN in reference_logits"):
        lmmetrics.token_kl(z, reference_logits=r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_evaluate_every_field(isa, dtype):
    z, r, t, tb = _data(6, dtype=dtype)
    m = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r)
    check_metrics(m, expected_metrics(z, t, tb, r))
    d = m.as_dict()
    means = {"loss", "bits_per_token", "bits_per_byte", "accuracy", "entropy", "kl", "same_top", "loss_diff"}
    assert set(d) == {"tokens", "ignored", "bytes", "nll_sum", "loss", "perplexity", "bits_per_token",
                      "bits_per_byte", "accuracy", "entropy", "kl", "same_top", "loss_ref", "loss_diff",
                      "perplexity_low", "perplexity_high"} | {k + "_stderr" for k in means}
    json.dumps(d)
    with pytest.raises(Exception):
        m.loss = 0.0  # frozen


def test_evaluate_without_extras():
    z, _, t, _ = _data(7)
    m = lmmetrics.evaluate(z, t)
    assert m.bytes is None and m.bits_per_byte is None and m.kl is None and m.same_top is None
    check_metrics(m, expected_metrics(z, t))
    assert m.loss == pytest.approx(lmmetrics.cross_entropy(z, t), rel=1e-12)
    assert "loss" in str(m)


def test_evaluate_accuracy_ties_take_the_lowest_index():
    z = np.zeros((4, 100), np.float32)
    z[:, [10, 20]] = 1.0
    m = lmmetrics.evaluate(z, np.array([10, 20, 10, 0]))
    assert m.accuracy == 0.5


def test_evaluate_no_counted_token():
    z, _, t, tb = _data(8)
    m = lmmetrics.evaluate(z, np.full_like(t, -100), token_bytes=tb)
    assert m.tokens == 0 and m.ignored == t.size
    assert math.isnan(m.loss) and math.isnan(m.accuracy) and m.bits_per_byte == math.inf


def test_evaluate_softcap_against_tanh_first():
    z, r, t, tb = _data(9)
    z = z * 10
    c = 30.0
    capped = c * np.tanh(z.astype(np.float64) / c)
    m = lmmetrics.evaluate(z, t, token_bytes=tb, softcap=c)
    check_metrics(m, expected_metrics(capped, t, tb))
    for f in (lmmetrics.cross_entropy, lmmetrics.bits_per_token, lmmetrics.perplexity):
        assert f(z, t, softcap=c) == pytest.approx(f(capped, t), rel=1e-6)
    np.testing.assert_allclose(lmmetrics.token_entropy(z, softcap=c), ref_entropy(capped), atol=2e-6)
    assert lmmetrics.bits_per_byte(z, t, tb, softcap=c) == pytest.approx(m.bits_per_byte, rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_evaluator_chunks_equal_one_call(seed):
    z, r, t, tb = _data(10 + seed, shape=(64,))
    whole = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r)
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, 64), size=rng.integers(1, 6), replace=False))
    ev = lmmetrics.Evaluator(token_bytes=tb)
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, 64]):
        ev.update(z[a:b], t[a:b], reference_logits=r[a:b])
    got = ev.compute().as_dict()
    for k, v in whole.as_dict().items():
        assert got[k] == pytest.approx(v, rel=1e-12), k


def test_evaluator_merge_state_dict_reset():
    z, r, t, tb = _data(20, shape=(50,))
    whole = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r)
    a, b = lmmetrics.Evaluator(token_bytes=tb), lmmetrics.Evaluator(token_bytes=tb)
    a.update(z[:20], t[:20], reference_logits=r[:20])
    b.update(z[20:], t[20:], reference_logits=r[20:])
    c = lmmetrics.Evaluator(token_bytes=tb)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    c.merge(b)
    for k, v in whole.as_dict().items():
        assert c.compute().as_dict()[k] == pytest.approx(v, rel=1e-12), k
    c.reset()
    assert c.compute().tokens == 0
    with pytest.raises(ValueError, match="token_bytes"):
        c.merge(lmmetrics.Evaluator())
    with pytest.raises(ValueError, match="not an Evaluator state"):
        c.load_state_dict({"tokens": 1})


def test_evaluator_merge_into_itself_is_refused():
    """`total.merge(e) for e in evaluators` with total among them would count
    total's batches twice: an error, and nothing changes."""
    z, _, t, _ = _data(22, shape=(30,))
    ev = lmmetrics.Evaluator()
    ev.update(z, t)
    before = ev.state_dict()
    with pytest.raises(ValueError, match="into itself: its sums would count twice"):
        ev.merge(ev)
    assert ev.state_dict() == before
    assert ev.compute().tokens == int(np.count_nonzero(t >= 0))
    ev.merge(copy.deepcopy(ev))  # twice on purpose: a copy
    assert ev.compute().tokens == 2 * int(np.count_nonzero(t >= 0))


def test_evaluator_batches_of_another_vocabulary_are_refused():
    """One Evaluator scores one vocabulary: a batch (or a merged Evaluator's
    batches) with logits of another width was summed with the others (a
    mean over two vocabularies' tokens) unless token_bytes fixed the width;
    now an error naming both sizes, nothing added. reset() and
    load_state_dict() start over."""
    z, _, t, _ = _data(23, shape=(30,), V=40)
    wider = np.concatenate([z, np.zeros((30, 8), z.dtype)], axis=1)
    ev = lmmetrics.Evaluator(top_k=2)
    ev.update(z[:10], t[:10])
    before = ev.state_dict()
    for logits in (wider[10:], wider[10:10], z[10:, :30]):
        with pytest.raises(ValueError, match=r"Evaluator.update: this batch's logits have \d+ columns .*"
                                             r"batches had 40: one Evaluator scores one vocabulary"):
            ev.update(logits, np.minimum(t[10:10 + len(logits)], 29))
        assert ev.state_dict() == before
    other = lmmetrics.Evaluator(top_k=2)
    other.update(wider[10:], t[10:])
    with pytest.raises(ValueError, match="Evaluator.merge: the other Evaluator's batches had 48 columns"):
        ev.merge(other)
    assert ev.state_dict() == before
    ev.merge(lmmetrics.Evaluator(top_k=2))  # (no batch: no vocabulary to compare)
    fresh = lmmetrics.Evaluator(top_k=2)
    fresh.merge(other)
    with pytest.raises(ValueError, match="batches had 48"):  # (taken from the merged Evaluator)
        fresh.update(z[:5], t[:5])
    ev.reset()
    ev.update(wider[10:], t[10:])
    ev.load_state_dict(before)
    ev.update(z[10:], t[10:])
    assert ev.compute().tokens == lmmetrics.evaluate(z, t).tokens


def test_evaluator_kl_only_over_updates_with_reference():
    z, r, t, _ = _data(21, shape=(30,), ignore=False)
    ev = lmmetrics.Evaluator()
    ev.update(z[:10], t[:10])
    ev.update(z[10:], t[10:], reference_logits=r[10:])
    m = ev.compute()
    assert m.tokens == 30
    assert m.kl == pytest.approx(ref_kl(r[10:], z[10:]).mean(), rel=1e-6)


def test_evaluator_nll_only_check_vocab_and_bits_per_byte():
    z, _, t, tb = _data(23, shape=(40,))
    full = lmmetrics.Evaluator(token_bytes=tb)
    nll = lmmetrics.Evaluator(token_bytes=tb, nll_only=True)
    full.check_vocab(z.shape[-1])
    with pytest.raises(ValueError, match="token_bytes"):
        nll.check_vocab(z.shape[-1] + 1)
    lmmetrics.Evaluator().check_vocab(7)  # nothing to check without token_bytes
    for ev in (full, nll):
        ev.update(z, t)
    a, b = full.compute(), nll.compute()
    for k in ("tokens", "ignored", "bytes", "nll_sum", "loss", "perplexity", "bits_per_token", "bits_per_byte"):
        assert b.as_dict()[k] == a.as_dict()[k], k
    assert math.isnan(b.accuracy) and math.isnan(b.entropy)
    assert nll.bits_per_byte() == a.bits_per_byte
    with pytest.raises(ValueError, match="nll_only"):
        full.merge(nll)
    with pytest.raises(ValueError, match="token_bytes"):
        lmmetrics.Evaluator().bits_per_byte()
    with pytest.raises(TypeError, match="nll_only"):
        lmmetrics.Evaluator(nll_only="yes")


def test_evaluator_argument_errors():
    with pytest.raises(ValueError, match="softcap"):
        lmmetrics.Evaluator(softcap=-1.0)
    with pytest.raises(ValueError, match="num_threads"):
        lmmetrics.Evaluator(num_threads=0)
    z, _, t, _ = _data(22)
    with pytest.raises(ValueError, match="token_bytes"):
        lmmetrics.evaluate(z, t, token_bytes=np.ones(5, np.int64))


def test_every_quantity_identical_for_any_thread_count(isa):
    # one long row split across threads exercises the segment merge of every sum
    for shape in [(1, 200000), (2, 70001), (40, 3000)]:
        rng = np.random.default_rng(shape[1])
        z = random_logits(rng, shape, np.float32)
        r = (z + rng.standard_normal(shape) * 2).astype(np.float32)
        z[0, 150 % shape[1]] = 40.0  # the maxima rise late in the row
        r[0, -1] = 35.0
        t = rng.integers(0, shape[1], shape[0])
        runs = [lmmetrics.evaluate(z, t, reference_logits=r, num_threads=k).as_dict() for k in (1, 2, 3)]
        np.testing.assert_equal(runs[0], runs[1])  # (nan == nan: one token has no stderr)
        np.testing.assert_equal(runs[0], runs[2])
        np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r, num_threads=2), ref_kl(r, z), atol=2e-6)
        np.testing.assert_allclose(lmmetrics.token_entropy(z, num_threads=3), ref_entropy(z), atol=2e-6)
