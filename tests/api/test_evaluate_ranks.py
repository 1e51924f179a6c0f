"""evaluate / Evaluator with top_k and calibration_bins: top-k accuracy,
mean reciprocal rank and the expected calibration error against numpy
(ranks counted on the float32 logits, ECE binned independently), streamed,
merged and restored; none of it computed unless asked."""
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import ref_nll, ref_rank


def _data(seed=0, n=700, vocab=400):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    t = (z + rng.gumbel(size=z.shape)).argmax(-1)
    t[rng.random(n) < 0.05] = -100
    z[0, :] = 1.0  # a row of ties: the target's rank is its index
    return z, t


def _numpy(z, t, ks, bins):
    c = t >= 0
    zc, tc = z[c], t[c]
    rank = ref_rank(zc, tc)
    z64 = zc.astype(np.float64)
    p_top = np.exp(z64.max(-1) - np.log(np.exp(z64 - z64.max(-1, keepdims=True)).sum(-1)) - z64.max(-1))
    correct = zc.argmax(-1) == tc
    ece = 0.0
    for b in range(bins):  # equal-width bins, the last one closed
        lo, hi = b / bins, (b + 1) / bins
        inside = (p_top >= lo) & ((p_top < hi) if b < bins - 1 else (p_top <= hi))
        if inside.any():
            ece += inside.sum() / p_top.size * abs(correct[inside].mean() - p_top[inside].mean())
    return {k: (rank < k).mean() for k in ks}, (1.0 / (rank + 1)).mean(), ece, rank


def test_top_k_mrr_and_ece_against_numpy():
    z, t = _data()
    m = lmmetrics.evaluate(z, t, top_k=(1, 5, 20), calibration_bins=12)
    acc, mrr, ece, rank = _numpy(z, t, (1, 5, 20), 12)
    for k in (1, 5, 20):
        assert m.top_k_accuracy[k] == pytest.approx(acc[k], abs=1e-12)
        x = (rank < k).astype(float)
        assert m.stderr[f"top_{k}_accuracy"] == pytest.approx(x.std(ddof=1) / math.sqrt(x.size), rel=1e-9)
    assert m.mean_reciprocal_rank == pytest.approx(mrr, rel=1e-12)
    assert m.ece == pytest.approx(ece, abs=2e-6)  # the confidence within the NLL's 2e-6
    assert m.calibration.counts.sum() == m.tokens
    d = m.as_dict()
    assert {"top_1_accuracy", "top_5_accuracy_stderr", "mean_reciprocal_rank", "ece"} <= set(d)
    json.dumps(d)


def test_changing_the_result_bins_leaves_the_evaluator_sums():
    """compute()'s calibration is the result's own: normalizing its arrays in
    place (a reliability diagram) left the Evaluator's bins changed, and
    every later ece with them."""
    z, t = _data(2)
    ece = _numpy(z, t, (1,), 9)[2]
    ev = lmmetrics.Evaluator(calibration_bins=9)
    ev.update(z[:300], t[:300])
    cal = ev.compute().calibration
    cal.counts[:] = 0
    cal.conf_sum[:] /= 2
    cal.correct[:] = 0
    ev.update(z[300:], t[300:])
    m = ev.compute()
    assert m.ece == pytest.approx(ece, abs=2e-6)
    assert m.calibration.counts.sum() == m.tokens


def test_nothing_computed_unless_asked():
    z, t = _data(1)
    ev = lmmetrics.Evaluator()
    res = ev._update_rows(z, t)
    assert res.rank is None and res.top_logprob is None  # the pass was not asked for them
    m = ev.compute()
    assert m.top_k_accuracy == {} and m.mean_reciprocal_rank is None and m.ece is None
    assert not any(k.startswith(("top_", "mean_reciprocal", "ece")) for k in m.as_dict())


def test_streamed_merged_restored():
    z, t = _data(2)
    whole = lmmetrics.evaluate(z, t, top_k=(3, 10), calibration_bins=7).as_dict()
    a = lmmetrics.Evaluator(top_k=[10, 3], calibration_bins=7)
    b = lmmetrics.Evaluator(top_k=(3, 10), calibration_bins=7)
    a.update(z[:300], t[:300])
    b.update(z[300:], t[300:])
    a.merge(b)
    c = lmmetrics.Evaluator(top_k=(3, 10), calibration_bins=7)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for got in (a.compute().as_dict(), c.compute().as_dict()):
        assert got.keys() == whole.keys()
        for k, v in whole.items():
            assert got[k] == (v if v is None else pytest.approx(v, rel=1e-12, abs=1e-15)), k
    with pytest.raises(ValueError, match="different top_k or calibration_bins"):
        a.merge(lmmetrics.Evaluator(top_k=3, calibration_bins=7))
    state = a.state_dict()
    state["rank"]["hits"] = [-1, 2]
    with pytest.raises(ValueError, match="rank must hold"):
        c.load_state_dict(state)


def test_bad_options():
    z, t = _data(3, n=20, vocab=30)
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        lmmetrics.evaluate(z, t, top_k=0)
    with pytest.raises(ValueError, match="top_k 31 is above the vocabulary size 30"):
        lmmetrics.evaluate(z, t, top_k=(1, 31))
    with pytest.raises(TypeError, match="top_k must be an int"):
        lmmetrics.evaluate(z, t, top_k=2.5)
    with pytest.raises(ValueError, match="bins"):
        lmmetrics.evaluate(z, t, calibration_bins=0)
    ev = lmmetrics.Evaluator(top_k=31)  # checked against each batch's vocabulary, before any sum moves
    with pytest.raises(ValueError, match="above the vocabulary"):
        ev.update(z, t)
    assert ev.compute().tokens == 0


def test_loss_unchanged_by_the_extras():
    z, t = _data(4)
    plain = lmmetrics.evaluate(z, t)
    extra = lmmetrics.evaluate(z, t, top_k=5, calibration_bins=15)
    c = t >= 0
    assert extra.loss == plain.loss == pytest.approx(ref_nll(z[c].astype(np.float64), t[c]).mean(), rel=1e-6)


@pytest.mark.parametrize("shift", [False, True])
def test_compare_top_k_agreement(shift):
    """Is the reference's top-1 among the model's top k: numpy's rank of the
    reference's argmax in the model's float32 logits."""
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((3, 60, 200)) * 3).astype(np.float32)
    quant = (base + rng.standard_normal(base.shape) * 0.8).astype(np.float32)
    t = rng.integers(0, 200, (3, 60))
    t[0, :7] = -100
    c = lmmetrics.compare(quant, t, reference_logits=base, top_k=3, shift=shift)
    z, r, tt = (quant[:, :-1], base[:, :-1], t[:, 1:]) if shift else (quant, base, t)
    keep = tt >= 0
    zc, top = z[keep], r[keep].argmax(-1)
    rank = ref_rank(zc, top)
    want = (rank < 3).mean()
    assert c.top_k == 3 and c.top_k_agreement.value == pytest.approx(want, abs=1e-12)
    assert c.top_k_agreement.uncertainty == pytest.approx(math.sqrt(want * (1 - want) / (top.size - 1)))
    assert want > c.same_top.value  # top 3 holds more than top 1
    assert "Base top in top 3:" in str(c)
    plain = lmmetrics.compare(quant, t, reference_logits=base, shift=shift)
    assert plain.top_k_agreement is None and "Base top in top" not in str(plain)
    with pytest.raises(ValueError, match="top_k 201 is above the vocabulary size 200"):
        lmmetrics.compare(quant, t, reference_logits=base, top_k=201, shift=shift)


def test_cli_compare_top_k(tmp_path, capsys):
    from lmmetrics.cli import main

    rng = np.random.default_rng(6)
    base = (rng.standard_normal((50, 100)) * 3).astype(np.float32)
    quant = (base + rng.standard_normal(base.shape) * 0.8).astype(np.float32)
    t = rng.integers(0, 100, 50)
    for name, a in (("b", base), ("q", quant), ("t", t)):
        np.save(tmp_path / f"{name}.npy", a)
    args = ["compare", str(tmp_path / "q.npy"), str(tmp_path / "t.npy"), "--reference", str(tmp_path / "b.npy"),
            "--top-k", "5", "--json", "--chunk-mb", "0.01"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    want = lmmetrics.compare(quant, t, reference_logits=base, top_k=5)
    assert got["top_k"] == 5 and got["top_k_agreement"]["value"] == pytest.approx(want.top_k_agreement.value)
