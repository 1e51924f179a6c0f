"""Standard errors, intervals and per-document (macro) means of evaluate /
Evaluator, against independent computations: numpy on float64 reference
values, scipy's bootstrap, llama.cpp's ± (through compare, which reproduces
it) and lm-eval's own aggregation functions."""
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import ref_entropy, ref_kl, ref_nll

scipy_stats = pytest.importorskip("scipy.stats")


def _data(seed=0, docs=12, per_doc=(20, 90), vocab=300):
    """Documents of varied length and difficulty (each its own logit scale,
    so tokens of one document are correlated), some ignored targets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(*per_doc, docs)
    n = int(lengths.sum())
    doc = np.repeat(np.arange(docs) * 7 + 3, lengths)  # ids need not be 0..G-1
    scale = np.repeat(rng.uniform(0.5, 4.0, docs), lengths)[:, None]
    z = (rng.standard_normal((n, vocab)) * scale).astype(np.float32)
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    t = rng.integers(0, vocab, n)
    t[rng.random(n) < 0.05] = -100
    tb = rng.integers(0, 6, vocab)
    return z, r, t, tb, doc


def _sample_se(x):
    return float(np.std(x, ddof=1) / np.sqrt(x.size))


def test_stderr_is_the_sample_standard_deviation_over_sqrt_n():
    z, r, t, tb, _ = _data()
    m = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r)
    c = t >= 0
    nll, ent, kl = ref_nll(z[c], t[c]), ref_entropy(z[c]), ref_kl(r[c], z[c])
    correct = (z[c].argmax(-1) == t[c]).astype(float)
    for name, x in [("loss", nll), ("entropy", ent), ("kl", kl), ("accuracy", correct)]:
        assert m.stderr[name] == pytest.approx(_sample_se(x), rel=1e-5, abs=1e-12), name
    assert m.stderr["bits_per_token"] == pytest.approx(_sample_se(nll) / math.log(2), rel=1e-5)
    same = (z[c].argmax(-1) == r[c].argmax(-1)).astype(float)
    assert m.stderr["same_top"] == pytest.approx(_sample_se(same), rel=1e-9)
    # the paired difference with the reference model on the same tokens
    # (a difference of two means is as uncertain as they are: each NLL is
    # within 2e-6 per token, so the mean difference within 4e-6 nats)
    diff = nll - ref_nll(r[c], t[c])
    assert m.loss_diff == pytest.approx(diff.mean(), rel=0, abs=4e-6)
    assert m.loss_ref == pytest.approx(ref_nll(r[c], t[c]).mean(), rel=1e-6)
    assert m.stderr["loss_diff"] == pytest.approx(_sample_se(diff), rel=0, abs=4e-6 / math.sqrt(c.sum() - 1))
    lo, hi = m.perplexity_interval
    assert lo == pytest.approx(math.exp(nll.mean() - 1.959964 * _sample_se(nll)), rel=1e-5)
    assert hi == pytest.approx(math.exp(nll.mean() + 1.959964 * _sample_se(nll)), rel=1e-5)


def test_stderr_against_scipy_bootstrap():
    z, r, t, tb, _ = _data(1, docs=30)
    m = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r)
    c = t >= 0
    nll = ref_nll(z[c], t[c])
    rng = np.random.default_rng(5)
    boot = scipy_stats.bootstrap((nll,), np.mean, n_resamples=4000, random_state=rng, method="percentile")
    assert m.stderr["loss"] == pytest.approx(boot.standard_error, rel=0.08)
    # bits per byte, a ratio of sums: the delta method against a paired bootstrap
    b = tb[t[c]].astype(float)
    x = np.where(b > 0, nll, 0.0)

    def bpb(xs, bs, axis=-1):
        return xs.sum(axis=axis) / bs.sum(axis=axis) / math.log(2)

    boot = scipy_stats.bootstrap((x, b), bpb, paired=True, vectorized=True, n_resamples=4000,
                                 random_state=rng, method="percentile")
    assert m.bits_per_byte == pytest.approx(bpb(x, b), rel=1e-6)
    assert m.stderr["bits_per_byte"] == pytest.approx(boot.standard_error, rel=0.1)


def test_stderr_matches_llama_cpp_through_compare():
    """compare reproduces llama.cpp's ± (its test suite checks that): the
    perplexity's ± is PPL times the loss's standard error, ln(PPL(Q)/PPL(base))'s
    is the paired difference's."""
    z, r, t, _, _ = _data(2)
    m = lmmetrics.evaluate(z, t, reference_logits=r)
    cmp = lmmetrics.compare(z, t, reference_logits=r)
    assert m.perplexity * m.stderr["loss"] == pytest.approx(cmp.ppl.uncertainty, rel=1e-6)
    assert m.loss_diff == pytest.approx(cmp.ln_ratio.value, rel=1e-9, abs=1e-12)
    assert m.stderr["loss_diff"] == pytest.approx(cmp.ln_ratio.uncertainty, rel=1e-4)
    assert m.stderr["kl"] == pytest.approx(cmp.kld.mean.uncertainty, rel=1e-6)


def test_streamed_merged_and_restored_give_the_same_stderr():
    z, r, t, tb, doc = _data(3)
    whole = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r, document_ids=doc)
    a, b = lmmetrics.Evaluator(token_bytes=tb), lmmetrics.Evaluator(token_bytes=tb)
    cut = [0, 100, 333, 500, len(t)]
    for i, (lo, hi) in enumerate(zip(cut, cut[1:])):  # a document split across batches and workers
        (a if i % 2 else b).update(z[lo:hi], t[lo:hi], reference_logits=r[lo:hi], document_ids=doc[lo:hi])
    restored = lmmetrics.Evaluator(token_bytes=tb)
    restored.load_state_dict(json.loads(json.dumps(a.merge(b).state_dict())))
    for m in (a.compute(), restored.compute()):
        assert m.per_document is not None and len(m.per_document) == whole.documents
        for k, v in whole.as_dict().items():
            assert m.as_dict()[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_macro_means_and_per_document_values():
    z, r, t, tb, doc = _data(4)
    m = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r, document_ids=doc)
    c = t >= 0
    nll = np.zeros(len(t))
    nll[c] = ref_nll(z[c], t[c])
    ids = np.unique(doc)
    loss = np.array([nll[(doc == d) & c].mean() for d in ids])
    nbytes = np.array([tb[t[(doc == d) & c]].sum() for d in ids])
    bpb = np.array([nll[(doc == d) & c & (tb[np.maximum(t, 0)] > 0)].sum() for d in ids]) / nbytes / math.log(2)
    acc = np.array([(z[(doc == d) & c].argmax(-1) == t[(doc == d) & c]).mean() for d in ids])
    kl = np.array([ref_kl(r[(doc == d) & c], z[(doc == d) & c]).mean() for d in ids])
    per = m.per_document
    np.testing.assert_array_equal(per.ids, ids)
    np.testing.assert_array_equal(per.tokens, [((doc == d) & c).sum() for d in ids])
    np.testing.assert_allclose(per.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(per.bits_per_byte, bpb, rtol=1e-5)
    np.testing.assert_allclose(per.accuracy, acc)
    np.testing.assert_allclose(per.kl, kl, rtol=1e-4, atol=1e-9)
    assert m.documents == len(ids)
    assert m.macro_loss == pytest.approx(loss.mean(), rel=1e-6)
    assert m.macro_perplexity == pytest.approx(math.exp(loss.mean()), rel=1e-6)
    assert m.macro_bits_per_byte == pytest.approx(bpb.mean(), rel=1e-6)
    assert m.macro_accuracy == pytest.approx(acc.mean())
    assert m.macro_kl == pytest.approx(kl.mean(), rel=1e-4)
    assert m.stderr["macro_loss"] == pytest.approx(_sample_se(loss), rel=1e-6)
    assert m.macro_loss != pytest.approx(m.loss, rel=1e-3)  # documents of other lengths: macro is not micro
    d = per.as_dict()[int(ids[0])]
    assert d["tokens"] == per.tokens[0] and d["loss"] == pytest.approx(loss[0], rel=1e-5)


def test_clustered_stderr_against_a_document_bootstrap():
    """Tokens of one document share its difficulty: the standard error over
    documents (cluster-robust) is the honest one; check it against the
    formula written out and against a bootstrap that resamples documents."""
    z, r, t, tb, doc = _data(6, docs=40)
    m = lmmetrics.evaluate(z, t, document_ids=doc)
    c = t >= 0
    nll = ref_nll(z[c], t[c])
    ids = np.unique(doc[c])
    s = np.array([nll[doc[c] == d].sum() for d in ids])
    n = np.array([(doc[c] == d).sum() for d in ids], float)
    mean = s.sum() / n.sum()
    g = len(ids)
    written = math.sqrt(g / (g - 1) * sum((sg - mean * ng) ** 2 for sg, ng in zip(s, n))) / n.sum()
    assert m.stderr_documents["loss"] == pytest.approx(written, rel=1e-5)
    boot = scipy_stats.bootstrap((s, n), lambda a, b, axis=-1: a.sum(axis) / b.sum(axis), paired=True,
                                 vectorized=True, n_resamples=4000, random_state=np.random.default_rng(1),
                                 method="percentile")
    assert m.stderr_documents["loss"] == pytest.approx(boot.standard_error, rel=0.12)
    assert m.stderr_documents["loss"] > 1.5 * m.stderr["loss"]  # correlated tokens: the iid one is too small
    lo, hi = m.perplexity_interval_documents
    assert lo == pytest.approx(math.exp(mean - 1.959964 * written), rel=1e-5)


def test_lm_eval_per_document_aggregation():
    """lm-eval scores a document as (loglikelihood, weight) and aggregates
    with weighted_perplexity / bits_per_byte: the same numbers."""
    metrics = pytest.importorskip("lm_eval.api.metrics")
    z, r, t, tb, doc = _data(7)
    m = lmmetrics.evaluate(z, t, token_bytes=tb, document_ids=doc)
    per = m.per_document
    c = t >= 0
    nll = np.zeros(len(t))
    nll[c] = ref_nll(z[c], t[c])
    ll = [-nll[doc == d].sum() for d in per.ids]  # lm-eval's per-document loglikelihood
    nbytes = [int(tb[t[(doc == d) & c]].sum()) for d in per.ids]
    words = {int(d): int(w) for d, w in zip(per.ids, np.random.default_rng(0).integers(5, 50, len(per.ids)))}
    np.testing.assert_allclose(per.loglikelihood, ll, rtol=1e-6)
    assert per.byte_perplexity() == pytest.approx(metrics.weighted_perplexity(list(zip(ll, nbytes))), rel=1e-6)
    assert per.corpus_bits_per_byte() == pytest.approx(metrics.bits_per_byte(list(zip(ll, nbytes))), rel=1e-6)
    assert per.word_perplexity(words) == pytest.approx(
        metrics.weighted_perplexity(list(zip(ll, [words[int(d)] for d in per.ids]))), rel=1e-6)
    assert per.word_perplexity([words[int(d)] for d in per.ids]) == pytest.approx(per.word_perplexity(words))
    with pytest.raises(ValueError, match="no count for document"):
        per.word_perplexity({})


def test_document_ids_shift_with_the_targets():
    rng = np.random.default_rng(8)
    z = rng.standard_normal((2, 9, 50)).astype(np.float32)
    ids = rng.integers(0, 50, (2, 9))
    doc = np.array([[0] * 4 + [1] * 5, [2] * 9])
    m = lmmetrics.evaluate(z, ids, document_ids=doc, shift=True)
    aligned = lmmetrics.evaluate(z[:, :-1], ids[:, 1:], document_ids=doc[:, 1:])
    np.testing.assert_array_equal(m.per_document.tokens, [3, 5, 8])
    a, b = m.as_dict(), aligned.as_dict()
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert a[k] == (v if v is None else pytest.approx(v, rel=1e-12)), k


def test_document_ids_bad_input():
    rng = np.random.default_rng(9)
    z = rng.standard_normal((4, 30)).astype(np.float32)
    t = rng.integers(0, 30, 4)
    with pytest.raises(ValueError, match=r"document_ids shape \(3,\) does not match the targets shape \(4,\)"):
        lmmetrics.evaluate(z, t, document_ids=np.zeros(3, int))
    with pytest.raises(TypeError, match="document_ids must hold integers"):
        lmmetrics.evaluate(z, t, document_ids=np.zeros(4))
    ev = lmmetrics.Evaluator()
    ev.update(z, t, document_ids=np.zeros(4, int))
    with pytest.raises(ValueError, match="give them for every batch"):
        ev.update(z, t)
    ev = lmmetrics.Evaluator()
    ev.update(z, t)
    with pytest.raises(ValueError, match="earlier batches had none"):
        ev.update(z, t, document_ids=np.zeros(4, int))
    state = lmmetrics.Evaluator().state_dict()
    state["documents"] = {"ids": [1, 1]}
    with pytest.raises(ValueError, match="documents"):
        lmmetrics.Evaluator().load_state_dict(state)


def test_too_few_tokens_give_nan_not_a_number():
    z = np.zeros((1, 5), np.float32)
    m = lmmetrics.evaluate(z, np.array([1]))
    assert math.isnan(m.stderr["loss"]) and math.isnan(m.perplexity_interval[0])
    assert "±" not in str(m).splitlines()[4]  # loss: no made-up uncertainty


def test_clustered_stderr_counts_only_the_documents_that_hold_the_mean():
    """A document with no token of a mean (no reference logits for the KL,
    no byte for bits per byte) is not one of its units: with one document
    that has them the standard error is nan (not 0), and adding a document
    without them leaves it as it was, as it leaves the macro mean."""
    z, r, t, tb, doc = _data(7, docs=6)
    c = t >= 0
    tb = tb.copy()
    tb[t[c & (doc == doc[-1])]] = 0  # the last document: no byte
    with_ref = doc < doc[-1] - 7 * 2  # the last three documents: no reference logits
    ev = lmmetrics.Evaluator(token_bytes=tb)
    ev.update(z[with_ref], t[with_ref], reference_logits=r[with_ref], document_ids=doc[with_ref])
    ev.update(z[~with_ref], t[~with_ref], document_ids=doc[~with_ref])
    m = ev.compute()
    nll = np.zeros(len(t))
    nll[c] = ref_nll(z[c], t[c])
    kl = np.zeros(len(t))
    kl[c] = ref_kl(r[c], z[c])

    def written(values, counts, keep):
        ids = np.unique(doc[keep])
        s = np.array([values[keep & (doc == d)].sum() for d in ids])
        n = np.array([counts[keep & (doc == d)].sum() for d in ids], float)
        g, mean = len(ids), s.sum() / n.sum()
        return math.sqrt(g / (g - 1) * np.sum((s - mean * n) ** 2)) / n.sum()

    assert m.stderr_documents["kl"] == pytest.approx(written(kl, np.ones(len(t)), c & with_ref), rel=1e-4)
    b = np.where(c, tb[np.maximum(t, 0)], 0)
    want_bpb = written(np.where(b > 0, nll, 0.0), b, c & (b > 0)) / math.log(2)
    assert m.stderr_documents["bits_per_byte"] == pytest.approx(want_bpb, rel=1e-5)
    one = lmmetrics.Evaluator()
    first = doc == doc[0]
    one.update(z[first], t[first], reference_logits=r[first], document_ids=doc[first])
    one.update(z[~first], t[~first], document_ids=doc[~first])
    assert math.isnan(one.compute().stderr_documents["kl"]) and math.isnan(one.compute().stderr["macro_kl"])


def test_a_ruled_out_target_without_bytes_leaves_bits_per_byte_and_its_stderr_finite():
    """A target the model rules out (NLL inf) whose token has no byte (a
    special token) leaves both sums of bits per byte: the value and its
    standard error are those of the other tokens (it was NaN in the sum of
    nll * bytes, inf * 0: an inf standard error and a state_dict that
    load_state_dict refused)."""
    rng = np.random.default_rng(5)
    z = rng.standard_normal((9, 4))
    t = np.array([0, 1, 2, 3, 0, 2, 3, 1, 2])
    z[1, 1] = z[7, 1] = -np.inf  # token 1 ruled out twice
    tb = np.array([2, 0, 1, 3])  # token 1: no byte
    with np.errstate(all="raise"):
        ev = lmmetrics.Evaluator(token_bytes=tb)
        ev.update(z, t)
    m = ev.compute()
    assert m.loss == math.inf
    keep = tb[t] > 0
    nll = np.where(keep, ref_nll(np.where(np.isinf(z), 0.0, z), t), 0.0)  # (the ruled-out rows leave the sums)
    b = tb[t].astype(float)
    ratio = nll.sum() / b.sum()
    n = len(t)
    want = math.sqrt(n / (n - 1) * np.sum((nll - ratio * b) ** 2)) / b.sum() / math.log(2)
    assert m.bits_per_byte == pytest.approx(ratio / math.log(2), rel=1e-12)
    assert m.stderr["bits_per_byte"] == pytest.approx(want, rel=1e-9)
    state = ev.state_dict()
    again = lmmetrics.Evaluator(token_bytes=tb)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == state


def test_a_target_the_reference_rules_out_gives_loss_diff_an_infinite_stderr():
    """The reference ruling a target out makes the paired difference -inf
    there: loss_diff is -inf and its standard error inf, as loss's is when
    the model rules one out (it was nan: -inf + inf in the check for NaN)."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((5, 4))
    r = z + 0.1 * rng.standard_normal(z.shape)
    t = np.array([0, 1, 2, 3, 0])
    r[2, 2] = -np.inf
    m = lmmetrics.evaluate(z, t, reference_logits=r)
    assert m.loss_ref == math.inf and m.loss_diff == -math.inf
    assert m.stderr["loss_diff"] == math.inf
    z[2, 2] = -np.inf  # both rule it out: the difference there is undefined, and so the mean and its spread
    m = lmmetrics.evaluate(z, t, reference_logits=r)
    assert math.isnan(m.loss_diff) and math.isnan(m.stderr["loss_diff"])


def test_macro_stderr_is_exact_for_equal_documents_and_finite_past_squares_range():
    """The macro standard errors are over the documents' values, which
    are at hand: a two-pass standard deviation, not one from their sum of
    squares. Equal documents give 0 (the sums gave ~3e-8 for losses of
    ln 1000 and 5e-6 for perplexities of 1000), and perplexities past 1e154,
    whose squares overflow, a finite number (the sums gave inf)."""
    z = np.zeros((40, 1000), np.float32)  # every token ln 1000, every document alike
    m = lmmetrics.evaluate(z, np.zeros(40, int), document_ids=np.arange(40) // 4)
    for name in ("macro_loss", "macro_bits_per_token", "macro_entropy", "macro_accuracy", "mean_perplexity"):
        assert m.stderr[name] == 0.0, name
    v = np.array([-360.0, -362, -364, -366, -368, -370])  # the target's logit: a loss of ~360 nats a document
    z = np.zeros((6, 4))
    z[np.arange(6), 0] = v
    m = lmmetrics.evaluate(z, np.zeros(6, int), document_ids=np.arange(6))
    ppl = np.exp(m.per_document.loss)
    scale = ppl.max()
    want = float(np.std(ppl / scale, ddof=1) / math.sqrt(6)) * scale  # (scaled: ppl ** 2 overflows)
    assert math.isfinite(want) and m.stderr["mean_perplexity"] == pytest.approx(want, rel=1e-12)
    assert m.mean_perplexity == pytest.approx(float(np.mean(ppl / scale)) * scale, rel=1e-12)


def test_mean_perplexity_past_float64_sum_is_finite_without_a_warning():
    """Documents' perplexities near float64's top (losses of ~708 nats),
    each finite but summing past float64's range: their mean and its
    standard error are finite, from values scaled by a power of two (the
    sum gave a mean of inf and, in the two-pass standard error, an overflow
    warning and nan)."""
    import warnings

    v = np.array([-700.0] + [-708.5] * 10)  # the target's logit: a document's loss of 700 or 708.5 nats
    z = np.zeros((11, 4))
    z[np.arange(11), 0] = v
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = lmmetrics.evaluate(z, np.zeros(11, int), document_ids=np.arange(11))
    ppl = np.exp(m.per_document.loss)
    with np.errstate(over="ignore"):
        assert np.isfinite(ppl).all() and np.sum(ppl) == math.inf
    scale = ppl.max()
    want = float(np.std(ppl / scale, ddof=1) / math.sqrt(11)) * scale
    assert math.isfinite(want) and m.stderr["mean_perplexity"] == pytest.approx(want, rel=1e-12)
    assert m.mean_perplexity == pytest.approx(float(np.mean(ppl / scale)) * scale, rel=1e-12)
