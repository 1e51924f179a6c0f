"""lmmetrics.convert and lmmetrics.probs, with the seed documents' examples."""
import math

import numpy as np
import pytest

import lmmetrics
from lmmetrics import convert, probs


def test_units():
    assert convert.nats_to_bits(math.log(2)) == pytest.approx(1.0)
    assert convert.bits_to_nats(1.0) == pytest.approx(math.log(2))
    np.testing.assert_allclose(convert.nats_to_bits(np.array([0.0, math.log(4)])), [0, 2])


def test_bpc_ppl_round_trip_and_errors():
    bpc = convert.bpc_from_perplexity(20.0, 100, 450)
    assert bpc == pytest.approx(100 / 450 * math.log(20) / math.log(2))
    assert convert.perplexity_from_bpc(bpc, 100, 450) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="num_chars"):
        convert.bpc_from_perplexity(20.0, 100, 0)
    for ppl in (-1.0, 0.5, math.nan, math.inf):   # (0.5: a negative BPC)
        with pytest.raises(ValueError, match="ppl"):
            convert.bpc_from_perplexity(ppl, 100, 10)
    for bpc in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="bpc"):
            convert.perplexity_from_bpc(bpc, 100, 10)
    assert convert.bpc_from_perplexity(1.0, 100, 10) == 0.0 and convert.perplexity_from_bpc(0.0, 100, 10) == 1.0
    # a perplexity of inf (a mean NLL past ~709.78 nats) has a finite BPC it no longer says: the error says
    # where to take it from, and perplexity() does return inf there
    logits = np.array([[0.0, -800.0]] * 3)
    assert lmmetrics.perplexity(logits, [1, 1, 1]) == math.inf
    with pytest.raises(ValueError, match="bits_per_character"):
        convert.bpc_from_perplexity(math.inf, 3, 12)
    bpc = lmmetrics.bits_per_character(logits, [1, 1, 1], token_chars=[4, 4])   # 3 tokens, 12 characters
    assert bpc == pytest.approx(3 / 12 * 800 / math.log(2))


def test_one_positive_integer_check():
    """A count that is not a positive integer is the same ValueError everywhere."""
    from lmmetrics import _engine, sliding_window_nll

    try:
        import torch
    except ImportError:
        torch = None

    assert _engine.check_positive_int("n", np.int64(3)) == 3
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            _engine.check_positive_int("n", bad)
        with pytest.raises(ValueError, match="num_chars must be a positive integer"):
            convert.bpc_from_perplexity(20.0, 100, bad)
        if torch is not None:
            with pytest.raises(ValueError, match="batch_size must be a positive integer"):
                sliding_window_nll(None, torch.arange(5), max_length=4, batch_size=bad)


def test_corpus_metrics_like_lm_eval():
    ll = [-120.0, -30.5, -77.25]
    words = [40, 10, 25]
    nbytes = [200, 51, 130]
    m = convert.corpus_metrics(ll, words=words, bytes=nbytes)
    total = sum(ll)
    assert m["word_perplexity"] == pytest.approx(math.exp(-total / sum(words)))
    assert m["byte_perplexity"] == pytest.approx(math.exp(-total / sum(nbytes)))
    assert m["bits_per_byte"] == pytest.approx(-total / sum(nbytes) / math.log(2))
    # not the mean of per-document ratios
    assert m["bits_per_byte"] != pytest.approx(np.mean([-a / b / math.log(2) for a, b in zip(ll, nbytes)]))
    only = convert.corpus_metrics(ll, words=words)
    assert only["bits_per_byte"] is None and only["byte_perplexity"] is None
    with pytest.raises(ValueError, match="one count per log-likelihood"):
        convert.corpus_metrics(ll, words=[1, 2])


# seeds/004: the pet corpus
Q = np.array([0.4, 0.4, 0.1, 0.1])   # model: dog, cat, gecko, rock
P = np.array([0.4, 0.5, 0.05, 0.05])  # true distribution


def test_pet_corpus_values():
    assert probs.entropy(Q) == pytest.approx(1.7219280948873623, abs=1e-12)
    assert probs.cross_entropy(P, Q) == pytest.approx(1.52193, abs=5e-6)
    assert probs.entropy(P) == pytest.approx(1.46096, abs=5e-6)
    assert probs.kl_divergence(P, Q) == pytest.approx(0.06096, abs=5e-6)
    assert probs.kl_divergence(P, P) == pytest.approx(0.0, abs=1e-15)
    # the test set: dog x3, cat x4, gecko x2, rock x1 -> CE 1.92193 bits, perplexity 3.79
    test_dist = np.array([3, 4, 2, 1]) / 10
    ce = probs.cross_entropy(test_dist, Q)
    assert ce == pytest.approx(1.92193, abs=5e-6)
    assert 2 ** ce == pytest.approx(3.79, abs=5e-3)
    assert probs.perplexity(Q) == pytest.approx(2 ** 1.7219280948873623)
    # KL = CE - H
    assert probs.kl_divergence(P, Q) == pytest.approx(probs.cross_entropy(P, Q) - probs.entropy(P))


def test_bases_zero_terms_and_rows():
    assert probs.entropy([0.5, 0.5, 0.0], base=math.e) == pytest.approx(math.log(2))
    assert probs.entropy([1.0, 0.0]) == 0.0
    assert probs.kl_divergence([0.5, 0.5], [1.0, 0.0]) == float("inf")
    assert probs.cross_entropy([0.0, 1.0], [0.0, 1.0]) == 0.0
    rows = probs.entropy(np.array([[0.5, 0.5], [1.0, 0.0]]))
    np.testing.assert_allclose(rows, [1.0, 0.0])


def test_probability_validation():
    with pytest.raises(ValueError, match="negative"):
        probs.entropy([1.2, -0.2])
    with pytest.raises(ValueError, match="sum to 1"):
        probs.entropy([0.5, 0.4])
    with pytest.raises(ValueError, match="same shape"):
        probs.kl_divergence([0.5, 0.5], [0.2, 0.3, 0.5])
    with pytest.raises(ValueError, match="base"):
        probs.entropy([0.5, 0.5], base=1)


def test_probability_inputs_refused_or_read_whole():
    """atol and base that would switch a check off or give a silent 0 are
    refused; complex input is refused (numpy dropped the imaginary part);
    a bfloat16 tensor is read (numpy cannot view it)."""
    for atol in (math.nan, -1e-3, math.inf, True, "1e-6"):
        with pytest.raises(ValueError, match="atol"):
            probs.entropy([0.3, 0.3], atol=atol)
    for base in (math.inf, math.nan, 0, 1, -2):
        with pytest.raises(ValueError, match="base"):
            probs.entropy([0.5, 0.5], base=base)
    with pytest.raises(TypeError, match="real probabilities"):
        probs.entropy(np.array([0.5 + 0.1j, 0.5]))
    want = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    assert probs.entropy([0.25, 0.75], atol=np.array(1e-6)) == pytest.approx(want)   # (a 0-d array is a number)
    torch = pytest.importorskip("torch")
    assert probs.entropy(torch.tensor([0.25, 0.75]).bfloat16(), atol=torch.tensor(1e-6)) == pytest.approx(want)
    with pytest.raises(TypeError, match="real probabilities"):
        probs.entropy(torch.tensor([0.5 + 0.1j, 0.5]))


def test_corpus_counts_and_log_likelihoods_are_checked():
    """Counts must be whole numbers >= 0 (a string, a bool, NaN, inf or a
    fraction was read as a number); a log-likelihood above 0 (a negated
    NLL forgotten) is refused, where it gave a perplexity below 1; a count
    of 0 gives inf, from corpus_metrics and per-document sums alike, and a
    perplexity beyond float's range is inf there too (it raised)."""
    import lmmetrics

    for words in (["2"], [True], [math.nan], [math.inf], [2.5], [-1]):
        with pytest.raises(ValueError, match="words must be whole counts"):
            convert.corpus_metrics([-3.0], words=words)
    assert convert.corpus_metrics([-3.0], words=[np.int32(2)])["word_perplexity"] == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError, match="must be <= 0.*negatives"):
        convert.corpus_metrics([3.0], words=[2])
    z = np.zeros((3, 4), np.float32)
    z[:, 0] = 400.0                                   # each target's NLL 400: exp(1200) overflows
    per = lmmetrics.evaluate(z, np.array([1, 1, 1]), document_ids=np.zeros(3, int)).per_document
    ll = list(-per.nll_sum)
    assert per.word_perplexity([1]) == convert.corpus_metrics(ll, words=[1])["word_perplexity"] == math.inf
    assert per.word_perplexity([0]) == convert.corpus_metrics(ll, words=[0])["word_perplexity"] == math.inf
    assert per.word_perplexity([4000]) == pytest.approx(math.exp(1200 / 4000), rel=1e-6)
    for words in (["1"], [0.5], {0: math.nan}):
        with pytest.raises(ValueError, match="words must be whole counts"):
            per.word_perplexity(words)


def test_a_certain_outcome_has_entropy_plus_zero():
    """A distribution with all its mass on one outcome: entropy and the
    cross-entropy of it with itself are +0.0, not -0.0 (which prints as
    '-0.0'); other values keep their sign."""
    for p in ([1.0, 0.0], [0.0, 0.0, 1.0]):
        for h in (probs.entropy(p), probs.cross_entropy(p, p), probs.entropy(p, base=math.e)):
            assert h == 0.0 and math.copysign(1.0, h) == 1.0, (p, h)
    rows = probs.entropy([[1.0, 0.0], [0.5, 0.5]])
    assert math.copysign(1.0, rows[0]) == 1.0 and rows[1] == 1.0
    assert probs.entropy([0.4, 0.4, 0.1, 0.1]) == pytest.approx(-sum(x * math.log2(x) for x in (0.4, 0.4, 0.1, 0.1)),
                                                                 rel=1e-15)


def test_sixteen_bit_probabilities_are_read_as_they_are():
    """The probabilities of a softmax rounded to float16 or bfloat16 (numpy's
    ml_dtypes or torch) sum to 1 only within their type's rounding (a
    bfloat16 [0.4, 0.4, 0.1, 0.1] sums to 1.00098): the default tolerance
    adds it, and the values are those of the rounded entries (scipy's entr,
    rel_entr on them in float64). ml_dtypes' bfloat16 was a TypeError
    ("must hold real probabilities"), every 16-bit row a ValueError; an
    explicit atol is kept, and a row off by more than the rounding is still
    refused."""
    special = pytest.importorskip("scipy.special")
    entr, rel_entr = special.entr, special.rel_entr
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    z = rng.normal(0, 3, (5, 1000))
    soft = np.exp(z - z.max(axis=1, keepdims=True))
    soft /= soft.sum(axis=1, keepdims=True)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        p, q = soft.astype(dtype), soft[::-1].astype(dtype)
        p64, q64 = p.astype(np.float64), q.astype(np.float64)
        assert np.abs(p64.sum(axis=1) - 1).max() > 1e-6          # (what the old default refused)
        np.testing.assert_allclose(probs.entropy(p, base=math.e), entr(p64).sum(axis=1), rtol=1e-13)
        np.testing.assert_allclose(probs.kl_divergence(p, q, base=math.e), rel_entr(p64, q64).sum(axis=1),
                                   rtol=1e-12)
        assert probs.entropy(np.array([0.4, 0.4, 0.1, 0.1], dtype)) == pytest.approx(
            entr(np.array([0.4, 0.4, 0.1, 0.1], dtype).astype(np.float64)).sum() / math.log(2), rel=1e-14)
        with pytest.raises(ValueError, match="sum to 1"):
            probs.entropy(np.array([0.4, 0.4, 0.1, 0.1], dtype), atol=1e-6)   # (an explicit atol is kept)
        with pytest.raises(ValueError, match="sum to 1"):
            probs.entropy(np.array([0.5, 0.48], dtype))                   # (2% off: not rounding)
    with pytest.raises(ValueError, match="sum to 1"):
        probs.entropy(np.array([0.5, 0.49999], np.float32))             # (1e-5 off in float32)
    torch = pytest.importorskip("torch")
    t = torch.softmax(torch.tensor(z), dim=-1)
    for dtype in (torch.float16, torch.bfloat16):
        p64 = t.to(dtype).double().numpy()
        np.testing.assert_allclose(probs.entropy(t.to(dtype), base=math.e), entr(p64).sum(axis=1), rtol=1e-13)


def test_a_negative_view_tensor_is_read_as_its_values():
    """A float64 tensor with the negative bit (the imaginary part of a
    conjugated complex tensor: its memory holds the values negated) is read
    as the values it stands for (it was torch's RuntimeError "Can't call
    numpy() on Tensor that has negative bit set"); a tensor with no dense
    values is named."""
    special = pytest.importorskip("scipy.special")
    torch = pytest.importorskip("torch")
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5], [0.125, 0.875]], dtype=torch.float64)
    neg = torch.complex(torch.zeros_like(q), -q).conj().imag
    assert neg.is_neg() and torch.equal(neg, q)
    np.testing.assert_allclose(probs.entropy(neg, base=math.e), special.entr(q.numpy()).sum(axis=1), rtol=1e-15)
    np.testing.assert_allclose(probs.kl_divergence(p, neg, base=math.e),
                               special.rel_entr(p.numpy(), q.numpy()).sum(axis=1), rtol=1e-15)
    np.testing.assert_allclose(probs.cross_entropy(neg, p), probs.cross_entropy(q, p), rtol=0)
    with pytest.raises(ValueError, match="p is on the meta device"):
        probs.entropy(p.to("meta"))
    with pytest.raises(TypeError, match="q must be a dense"):
        probs.kl_divergence(p, q.to_sparse())


def test_log_probabilities_are_refused_with_a_hint():
    """Log-probabilities (negative) are an error that says what to pass."""
    with pytest.raises(ValueError, match=r"negative entries \(log-probabilities\? pass their exp\)"):
        probs.entropy(np.log([0.25, 0.75]))


def test_corpus_bits_per_byte_of_certain_documents_is_plus_zero():
    """Log-likelihoods of 0 (every token certain) give 0.0 bits per byte, not
    -0.0 (which prints as '-0.0'), as probs' entropy of a certain outcome."""
    m = convert.corpus_metrics([0.0, -0.0], words=[3, 1], bytes=[5, 2])
    assert m["bits_per_byte"] == 0.0 and math.copysign(1.0, m["bits_per_byte"]) == 1.0
    assert m["word_perplexity"] == m["byte_perplexity"] == 1.0


def test_kl_of_close_distributions_keeps_its_digits():
    """KL(P || Q) of two close distributions (a quantized model's against
    its base's) against an exact reference (mpmath, 50 digits, from the same
    float64 entries): each term as log1p((p - q) / q) where p and q are
    within a factor 2 (the difference of logs, and the log of the rounded
    ratio, are 1e-16 off absolute: a KL of 1e-14 was 0.8% off); far apart,
    a subnormal q and q = 0 keep their values."""
    mp = pytest.importorskip("mpmath")
    rng = np.random.default_rng(3)
    for scale in (1e-2, 1e-4, 1e-6):
        z = rng.normal(0, 4, 300)
        p = np.exp(z - z.max())
        p /= p.sum()
        z2 = z + rng.normal(0, scale, 300)
        q = np.exp(z2 - z2.max())
        q /= q.sum()
        with mp.workdps(50):
            want = float(mp.fsum(mp.mpf(a) * mp.log(mp.mpf(a) / mp.mpf(b)) for a, b in zip(p, q)))
        assert probs.kl_divergence(p, q, base=math.e) == pytest.approx(want, rel=1e-8, abs=0), scale
    with mp.workdps(50):
        want = float(mp.log(1 / mp.mpf(5e-324)))                       # 744.44
    assert probs.kl_divergence([1.0, 0.0], [5e-324, 1.0], base=math.e) == pytest.approx(want, rel=1e-15)
    assert probs.kl_divergence([0.5, 0.5], [1.0, 0.0]) == math.inf
    p, q = [1e-300, 1 - 1e-300], [1e-10, 1 - 1e-10]
    with mp.workdps(50):
        want = float(mp.fsum(mp.mpf(a) * mp.log(mp.mpf(a) / mp.mpf(b)) for a, b in zip(p, q)))   # ~1e-10
    assert probs.kl_divergence(p, q, base=math.e) == pytest.approx(want, rel=1e-12, abs=0)
