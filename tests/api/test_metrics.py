"""Reductions and unit conversions of the NLL, the seed documents' worked
examples, and bits per byte against nanochat's algorithm."""
import math

import numpy as np
import pytest

import lmmetrics
from helpers import random_logits, ref_nll

LN2 = math.log(2)


def test_reductions_and_derived_metrics(isa):
    rng = np.random.default_rng(10)
    z = random_logits(rng, (4, 6, 300), np.float32)
    t = rng.integers(0, 300, (4, 6))
    t[0, :2] = -100
    ref = ref_nll(z, t)
    counted = t >= 0
    mean = ref[counted].mean()
    assert lmmetrics.cross_entropy(z, t) == pytest.approx(mean, abs=1e-6)
    assert lmmetrics.cross_entropy(z, t, reduction="sum") == pytest.approx(ref.sum(), rel=1e-7)
    none = lmmetrics.cross_entropy(z, t, reduction="none")
    assert none.shape == (4, 6)
    np.testing.assert_allclose(none, ref, atol=2e-6)
    assert lmmetrics.perplexity(z, t) == pytest.approx(math.exp(mean), rel=1e-6)
    assert lmmetrics.bits_per_token(z, t) == pytest.approx(mean / LN2, abs=2e-6)
    assert lmmetrics.bits_per_character(z, t) == pytest.approx(mean / LN2, abs=2e-6)


def test_all_ignored_mean_is_nan():
    z = np.zeros((2, 3), np.float32)
    t = np.array([-100, -1])
    assert math.isnan(lmmetrics.cross_entropy(z, t))
    assert math.isnan(lmmetrics.perplexity(z, t))
    assert lmmetrics.cross_entropy(z, t, reduction="sum") == 0.0


def test_seed_bpc_three_step_example():
    # seeds/000: 3 time steps, vocabulary A-D, true characters B, C, C
    logits = np.array([[2.0, 1.0, -1.0, -2.0], [-1.0, 2.0, 1.0, -2.0], [1.0, -1.0, 2.0, -2.0]], np.float32)
    true = np.array([1, 2, 2])
    z = logits.astype(np.float64)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    expected = float(np.mean(-log_probs[np.arange(3), true] / np.log(2)))
    assert lmmetrics.bits_per_character(logits, true) == pytest.approx(expected, abs=1e-6)
    assert lmmetrics.bits_per_token(logits, true) == pytest.approx(expected, abs=1e-6)


def test_seed_batch_perplexity():
    # seeds/003: perplexity over the batch printed as 2.909916162855865
    logits = np.array([[2.0, 1.0, 0.1], [1.5, 0.5, 0.0], [0.2, 1.2, 0.5]])
    labels = np.array([0, 1, 2])
    assert lmmetrics.perplexity(logits, labels) == pytest.approx(2.909916162855865, rel=1e-9)


def test_bpc_from_token_level_model_matches_ppl_relation():
    # seeds/002: BPC = N/T * ln(PPL)/ln 2 = sum(nll) / (T ln 2)
    rng = np.random.default_rng(11)
    V = 64
    z = random_logits(rng, (50, V), np.float64)
    t = rng.integers(0, V, 50)
    chars = rng.integers(1, 6, V)
    n_chars = int(chars[t].sum())
    bpc = lmmetrics.bits_per_character(z, t, token_chars=chars)
    assert bpc == pytest.approx(ref_nll(z, t).sum() / (n_chars * LN2), rel=1e-12)
    ppl = lmmetrics.perplexity(z, t)
    assert bpc == pytest.approx(lmmetrics.convert.bpc_from_perplexity(ppl, 50, n_chars), rel=1e-12)
    assert lmmetrics.convert.perplexity_from_bpc(bpc, 50, n_chars) == pytest.approx(ppl, rel=1e-12)


def _nanochat_bpb(z, y, token_bytes):
    """nanochat's loss_eval.evaluate_bpb for one batch, in float64 numpy."""
    nll = ref_nll(z, y, ignore_index=-1)
    valid = y >= 0
    y_safe = np.where(valid, y, 0)
    num_bytes = np.where(valid, token_bytes[y_safe], 0)
    total_nats = (nll * (num_bytes > 0)).sum()
    total_bytes = num_bytes.sum()
    return float("inf") if total_bytes == 0 else total_nats / (math.log(2) * total_bytes)


def test_bits_per_byte_matches_nanochat(isa):
    rng = np.random.default_rng(12)
    V = 500
    token_bytes = rng.integers(1, 8, V)
    token_bytes[[0, 1, 2]] = 0  # special tokens
    z = random_logits(rng, (3, 40, V), np.float32)
    y = rng.integers(0, V, (3, 40))
    y[0, :5] = -1  # nanochat's ignore index
    y[1, :3] = [0, 1, 2]  # specials: leave both sums
    got = lmmetrics.bits_per_byte(z, y, token_bytes)
    assert got == pytest.approx(_nanochat_bpb(z, y, token_bytes), rel=1e-6)
    # ignore_index=-100 covers -1 as well (every negative target is ignored)
    assert lmmetrics.bits_per_byte(z, y, token_bytes, ignore_index=-1) == got
    # token_bytes may be a list, numpy or torch table
    assert lmmetrics.bits_per_byte(z, y, list(token_bytes)) == got


def test_bits_per_byte_no_bytes_is_inf():
    z = np.zeros((3, 4), np.float32)
    assert lmmetrics.bits_per_byte(z, np.array([0, 0, -1]), np.array([0, 2, 2, 2])) == float("inf")


def test_table_errors():
    z = np.zeros((3, 4), np.float32)
    t = np.array([0, 1, 2])
    with pytest.raises(ValueError, match="token_bytes must be a 1-D table of length 4"):
        lmmetrics.bits_per_byte(z, t, np.ones(5, int))
    with pytest.raises(ValueError, match="negative"):
        lmmetrics.bits_per_byte(z, t, np.array([1, -1, 1, 1]))
    with pytest.raises(TypeError, match="integers"):
        lmmetrics.bits_per_byte(z, t, np.ones(4))
    with pytest.raises(ValueError, match="token_chars must be a 1-D table of length 4"):
        lmmetrics.bits_per_character(z, t, token_chars=[1, 2])


def test_a_tuple_or_dict_of_model_outputs_is_a_clear_error():
    """A model's outputs with return_dict=False, a (logits, cache) tuple, or
    a dict of them, were read by np.asarray: "setting an array element with
    a sequence" (or a requires-grad error), and a dict a 0-d object array
    ("got shape ()"). The error now says to pass the logits alone."""
    rng = np.random.default_rng(0)
    z = random_logits(rng, (2, 5, 7), np.float32)
    t = rng.integers(0, 7, (2, 5))

    class Cache:  # transformers' DynamicCache stands beside the logits
        pass

    for outputs in ((z, Cache()), [z, None], (z, z[:, :2])):
        for kw in ({"shift": True}, {}):
            with pytest.raises(TypeError, match=r"outputs\[0\]"):
                lmmetrics.perplexity(outputs, t, **kw)
        with pytest.raises(TypeError, match=r"outputs\[0\]"):
            lmmetrics.evaluate(z, t, reference_logits=outputs)
    with pytest.raises(TypeError, match=r"outputs\['logits'\]"):
        lmmetrics.perplexity({"logits": z, "past_key_values": None}, t, shift=True)
    # given labels, a model's outputs put its loss first: (loss, logits, cache)
    with pytest.raises(TypeError, match=r"pass the logits alone, outputs\[1\] \(outputs\[0\] is the loss\)"):
        lmmetrics.perplexity((np.array(2.5, np.float32), z, Cache()), t, shift=True)
    # what np.asarray reads as one array still goes: rows as nested lists, arrays of one shape
    want = float(np.exp(ref_nll(z, t).mean()))
    assert lmmetrics.perplexity(z.tolist(), t) == pytest.approx(want, rel=1e-6)
    assert lmmetrics.perplexity([z[0], z[1]], t) == pytest.approx(want, rel=1e-6)


def test_a_masked_array_with_masked_entries_is_refused_not_read_without_its_mask():
    """numpy hands over the values under a mask: masked logits (a vocabulary
    masked out), targets (positions masked out) or tables read so gave the
    numbers of the unmasked arrays, silently. Refused, saying what to pass;
    a masked array with nothing masked is read as its values."""
    rng = np.random.default_rng(5)
    z = rng.normal(size=(4, 7)).astype(np.float32)
    t = np.array([1, 2, 3, 4])
    zm = np.ma.masked_array(z, mask=np.zeros_like(z, bool))
    zm[:, 5] = np.ma.masked
    tm = np.ma.masked_array(t, mask=[False, True, False, False])
    with pytest.raises(TypeError, match=r"logits is a numpy masked array.*logits.filled\(-np.inf\)"):
        lmmetrics.cross_entropy(zm, t)
    with pytest.raises(TypeError, match=r"reference_logits is a numpy masked array"):
        lmmetrics.kl_divergence(z, reference_logits=zm)
    with pytest.raises(TypeError, match=r"targets is a numpy masked array.*targets.filled\(-100\)"):
        lmmetrics.cross_entropy(z, tm)
    with pytest.raises(TypeError, match=r"targets is a numpy masked array"):
        lmmetrics.evaluate(z[None], tm[None], shift=False)
    ev = lmmetrics.Evaluator()
    with pytest.raises(TypeError, match=r"document_ids is a numpy masked array"):
        ev.update(z, t, document_ids=np.ma.masked_array([0, 0, 1, 1], mask=[0, 0, 0, 1]))
    table = np.ma.masked_array(np.ones(7, np.int64), mask=[0] * 6 + [1])
    with pytest.raises(TypeError, match=r"token_bytes is a numpy masked array"):
        lmmetrics.bits_per_byte(z, t, table)
    # nothing masked: the values, as a plain array gives them (float64 reference)
    plain = np.ma.masked_array(z)
    want = float(np.mean(ref_nll(z.astype(np.float64), t)))
    assert lmmetrics.cross_entropy(plain, np.ma.masked_array(t)) == pytest.approx(want, rel=2e-6)


def test_masked_arrays_are_refused_by_the_functions_of_plain_values():
    """The same for probabilities, log-likelihoods, counts and calibration
    arrays: a masked entry is not read as absent."""
    from lmmetrics import convert, probs
    from lmmetrics.ranking import Calibration

    p = np.ma.masked_array([0.5, 0.25, 0.25], mask=[0, 0, 1])
    with pytest.raises(TypeError, match=r"p is a numpy masked array"):
        probs.entropy(p)
    ll = np.ma.masked_array([-2.0, -3.0], mask=[0, 1])
    with pytest.raises(TypeError, match=r"loglikelihoods is a numpy masked array"):
        convert.corpus_metrics(ll, bytes=[4, 5])
    with pytest.raises(TypeError, match=r"bytes is a numpy masked array"):
        convert.corpus_metrics([-2.0, -3.0], bytes=np.ma.masked_array([4, 5], mask=[1, 0]))
    with pytest.raises(TypeError, match=r"confidence is a numpy masked array"):
        Calibration.from_arrays(np.ma.masked_array([0.9, 0.2], mask=[0, 1]), [True, False])
    # nothing masked: the values (0.5 log2 2 + 2 * 0.25 log2 4 = 1.5 bits)
    assert probs.entropy(np.ma.masked_array([0.5, 0.25, 0.25])) == pytest.approx(1.5, rel=1e-15)
