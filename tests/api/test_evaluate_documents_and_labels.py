"""document_ids one per sequence or one for all (and the shapes refused),
Metrics.mean_perplexity against Hugging Face evaluate's "perplexity"
arithmetic, the KeyError of stderr["perplexity"], and the labels of the ±
values str(Metrics) shows."""
import math
import pickle

import numpy as np
import pytest

import lmmetrics

rng = np.random.default_rng(0)
V = 50


def logits_of(shape):
    return (rng.standard_normal(shape + (V,)) * 2).astype(np.float32)


def same_documents(a, b):
    """Two Metrics with the same documents: every value equal."""
    np.testing.assert_equal(a.as_dict(), b.as_dict())  # nan equal to nan
    np.testing.assert_equal(a.per_document.as_dict(), b.per_document.as_dict())


# --- document_ids: one per position, one per sequence, one for all ---

def test_one_id_per_sequence_is_repeated_along_it():
    z, t = logits_of((3, 5)), rng.integers(0, V, (3, 5))
    doc = np.array([4, 9, 4])
    full = np.repeat(doc[:, None], 5, axis=1)
    want = lmmetrics.evaluate(z, t, document_ids=full)
    same_documents(lmmetrics.evaluate(z, t, document_ids=doc), want)
    assert want.documents == 2
    torch = pytest.importorskip("torch")
    same_documents(lmmetrics.evaluate(z, t, document_ids=torch.tensor(doc)), want)


def test_one_id_for_all():
    z, t = logits_of((3, 5)), rng.integers(0, V, (3, 5))
    want = lmmetrics.evaluate(z, t, document_ids=np.full((3, 5), 7))
    for scalar in (7, np.int64(7), np.array(7)):
        m = lmmetrics.evaluate(z, t, document_ids=scalar)
        same_documents(m, want)
        assert m.documents == 1 and m.per_document.ids.tolist() == [7]


def test_b_equal_t_one_id_per_sequence_never_a_row_broadcast():
    """Targets (4, 4) and ids (4,): one id per sequence, by the rule (never
    numpy's broadcast of a (T,) row over the sequences)."""
    z, t = logits_of((4, 4)), rng.integers(0, V, (4, 4))
    doc = np.array([0, 1, 2, 3])
    m = lmmetrics.evaluate(z, t, document_ids=doc)
    same_documents(m, lmmetrics.evaluate(z, t, document_ids=np.repeat(doc[:, None], 4, axis=1)))
    by_column = lmmetrics.evaluate(z, t, document_ids=np.broadcast_to(doc, (4, 4)))
    assert not np.allclose(m.per_document.loss, by_column.per_document.loss)


def test_shapes_that_are_neither_are_refused_naming_the_three():
    z, t = logits_of((3, 5)), rng.integers(0, V, (3, 5))
    for bad in (np.arange(5), np.zeros((1, 5), np.int64), np.zeros((3, 1), np.int64), np.zeros((5, 3), np.int64),
                np.zeros(15, np.int64), np.zeros((1,), np.int64)):
        with pytest.raises(ValueError, match=r"one id per position \(3, 5\), one per sequence \(3,\) or one for all"):
            lmmetrics.evaluate(z, t, document_ids=bad)
    # 1-D targets: one id per position or one for all; no per-sequence shape
    z1, t1 = logits_of((5,)), rng.integers(0, V, 5)
    assert lmmetrics.evaluate(z1, t1, document_ids=np.arange(5)).documents == 5
    assert lmmetrics.evaluate(z1, t1, document_ids=3).documents == 1
    with pytest.raises(ValueError, match=r"one id per position \(5,\) or one for all"):
        lmmetrics.evaluate(z1, t1, document_ids=np.zeros(1, np.int64))
    # 3-D targets: the first axis only, never the first two
    z3, t3 = logits_of((2, 3, 4)), rng.integers(0, V, (2, 3, 4))
    same_documents(lmmetrics.evaluate(z3, t3, document_ids=np.array([5, 6])),
                   lmmetrics.evaluate(z3, t3, document_ids=np.repeat([5, 6], 12).reshape(2, 3, 4)))
    with pytest.raises(ValueError, match=r"one per sequence \(2,\)"):
        lmmetrics.evaluate(z3, t3, document_ids=np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="integers"):
        lmmetrics.evaluate(z, t, document_ids=np.array([0.0, 1.0, 2.0]))


def test_one_id_per_sequence_with_shift_and_across_updates():
    torch = pytest.importorskip("torch")
    batches = [(torch.from_numpy(logits_of((2, 6))), torch.from_numpy(rng.integers(0, V, (2, 6))),
                torch.tensor(d)) for d in ([0, 1], [1, 2])]
    per_seq = lmmetrics.Evaluator(shift=True)
    full = lmmetrics.Evaluator(shift=True)
    for z, t, d in batches:
        per_seq.update(z, t, document_ids=d)
        full.update(z, t, document_ids=d[:, None].expand(2, 6))
    same_documents(per_seq.compute(), full.compute())
    m = per_seq.compute()
    assert m.documents == 3 and m.per_document.tokens.tolist() == [5, 10, 5]  # shifted: 5 a sequence


# --- mean_perplexity: Hugging Face evaluate's ---

def hf_evaluate_compute(predictions, references, attention_mask):
    """evaluate's metrics/perplexity/perplexity.py ``Perplexity._compute``
    (the logits / labels / attention_mask form), in float64: each
    sequence's exp(mean CrossEntropyLoss over its attended positions), and
    np.mean of them."""
    torch = pytest.importorskip("torch")
    predictions, references = torch.as_tensor(predictions).double(), torch.as_tensor(references)
    attention_mask = torch.as_tensor(attention_mask).double()
    ppls = torch.exp(
        (torch.nn.CrossEntropyLoss(reduction="none")(predictions.transpose(1, 2), references) * attention_mask).sum(1)
        / attention_mask.sum(1)
    ).tolist()
    return {"perplexities": ppls, "mean_perplexity": np.mean(ppls)}


def test_mean_perplexity_is_hugging_face_evaluates():
    B, T = 6, 12
    z = logits_of((B, T)) * rng.uniform(0.3, 3.0, (B, 1, 1)).astype(np.float32)  # texts of unlike difficulty
    t = rng.integers(0, V, (B, T))
    lengths = rng.integers(3, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)   # right padding
    want = hf_evaluate_compute(z, t, mask)
    m = lmmetrics.evaluate(z, np.where(mask == 1, t, -100), document_ids=np.arange(B))
    assert m.mean_perplexity == pytest.approx(want["mean_perplexity"], rel=1e-6)
    np.testing.assert_allclose(np.exp(m.per_document.loss), want["perplexities"], rtol=1e-6)
    ppl = np.array(want["perplexities"])
    assert m.stderr["mean_perplexity"] == pytest.approx(ppl.std(ddof=1) / math.sqrt(B), rel=1e-6)
    # macro_perplexity is their geometric mean: below the arithmetic one
    assert m.macro_perplexity == pytest.approx(math.exp(np.log(ppl).mean()), rel=1e-6)
    assert m.macro_perplexity < m.mean_perplexity
    assert "mean_perplexity" in m.as_dict() and "mean_perplexity_stderr" in m.as_dict()
    # without documents there is none
    plain = lmmetrics.evaluate(z, t)
    assert plain.mean_perplexity is None and "mean_perplexity" not in plain.as_dict()


def test_mean_and_macro_perplexity_as_the_docstring_says():
    """99 documents of perplexity 10 and one of 1000: arithmetic mean 19.9,
    geometric 10.47."""
    losses = np.array([math.log(10)] * 99 + [math.log(1000)])
    # one token a document, its NLL the document's loss: p(target) = exp(-loss)
    # from a two-way softmax over the logits (log(1 - p), log p), target 1
    p = np.exp(-losses)
    z = np.stack([np.log1p(-p), np.log(p)], axis=1)
    m = lmmetrics.evaluate(z, np.ones(100, np.int64), document_ids=np.arange(100))
    assert m.mean_perplexity == pytest.approx(19.9, rel=1e-9)
    assert m.macro_perplexity == pytest.approx(10 ** 1.02, rel=1e-9)


# --- stderr: what to use for a perplexity ---

def test_stderr_perplexity_says_what_to_use():
    z, t = logits_of((4, 8)), rng.integers(0, V, (4, 8))
    m = lmmetrics.evaluate(z, t, document_ids=np.arange(4))
    with pytest.raises(KeyError, match=r"perplexity_interval .*perplexity \* stderr\['loss'\]"):
        m.stderr["perplexity"]
    with pytest.raises(KeyError, match=r"perplexity_interval_documents .*perplexity \* stderr_documents\['loss'\]"):
        m.stderr_documents["perplexity"]
    with pytest.raises(KeyError, match=r"macro_perplexity \* stderr\['macro_loss'\]"):
        m.stderr["macro_perplexity"]
    with pytest.raises(KeyError, match=r"no 'kl'; it has \['accuracy', 'bits_per_token'"):
        m.stderr["kl"]
    # still a dict in every other way
    assert m.stderr.get("perplexity") is None and "perplexity" not in m.stderr
    assert m.stderr == dict(m.stderr) and isinstance(m.stderr, dict)
    back = pickle.loads(pickle.dumps(m))
    assert back == m
    with pytest.raises(KeyError, match="perplexity_interval"):
        back.stderr["perplexity"]
    with pytest.raises(KeyError, match="perplexity_interval"):
        lmmetrics.evaluate(z, t).stderr["perplexity"]
    # the delta method the message names: perplexity * stderr["loss"] (llama.cpp's ±)
    lo, hi = m.perplexity_interval
    assert lo < m.perplexity - m.perplexity * m.stderr["loss"] < m.perplexity < hi


# --- str(Metrics): each ± says what it is ---

def _plus_minus(line):
    """[(value, label)] of each '± v (label)' of a line."""
    parts = line.split(" ± ")[1:]
    return [(p.split(" (")[0], p.split(" (")[1].split(")")[0]) for p in parts]


def test_str_labels_each_plus_minus_and_interval():
    z, t = logits_of((4, 8)), rng.integers(0, V, (4, 8))
    m = lmmetrics.evaluate(z, t, token_bytes=np.full(V, 2))
    lines = {ln.split()[0]: ln for ln in str(m).splitlines()}
    assert _plus_minus(lines["loss"]) == [(f"{m.stderr['loss']:.2g}", "se, tokens")]
    assert _plus_minus(lines["bits_per_byte"]) == [(f"{m.stderr['bits_per_byte']:.2g}", "se, tokens")]
    assert lines["perplexity"].endswith("(95%, tokens)")
    d = lmmetrics.evaluate(z, t, document_ids=np.arange(4))
    lines = {ln.split()[0]: ln for ln in str(d).splitlines()}
    assert _plus_minus(lines["loss"]) == [(f"{d.stderr['loss']:.2g}", "se, tokens"),
                                          (f"{d.stderr_documents['loss']:.2g}", "se, documents")]
    assert _plus_minus(lines["macro_loss"]) == [(f"{d.stderr['macro_loss']:.2g}", "se, documents")]
    assert _plus_minus(lines["mean_perplexity"]) == [(f"{d.stderr['mean_perplexity']:.2g}", "se, documents")]
    assert "(95%, tokens) [" in lines["perplexity"] and lines["perplexity"].endswith("(95%, documents)")
    assert all(" ± " not in ln or "(se, " in ln for ln in str(d).splitlines())


def test_document_sums_wait_and_fold_with_the_bits_of_adding_one_batch_after_another(monkeypatch):
    """Batches' document sums wait in a chain and join the table at once:
    the same bits as adding each batch to the table in turn (folding after
    every batch, as the table was rebuilt each batch before), a copy shares
    what it holds and does not see what is added to the other, and a small
    batch added to a large table leaves the table's arrays as they were."""
    from lmmetrics.documents import COLUMNS, DocumentSums

    rng = np.random.default_rng(5)
    batches = []
    for b in range(40):
        doc = rng.integers(0, 300, 50) + (b // 10) * 100  # documents spanning batches, new ones arriving
        batches.append((doc, {name: rng.random(50) * 10.0 ** rng.integers(-3, 8) for name in COLUMNS}))

    def build(fold_each):
        monkeypatch.setattr(DocumentSums, "_MIN_FOLD", 10**9)  # (nothing folds until read)
        d, copies = DocumentSums(), []
        for i, (doc, cols) in enumerate(batches):
            d.add_rows(doc, cols)
            if fold_each:
                assert d.ids.size and d._now[2] is None  # (read: folded)
            if i == 20:
                copies.append((d.copy(), i))
        return d, copies

    each, _ = build(True)
    waiting, copies = build(False)
    assert waiting._now[2] is not None
    np.testing.assert_array_equal(waiting.ids, each.ids)
    assert np.array_equal(waiting.sums, each.sums)  # bit for bit
    (early, i), = copies
    alone = DocumentSums()
    for doc, cols in batches[:i + 1]:
        alone.add_rows(doc, cols)
    np.testing.assert_array_equal(early.ids, alone.ids)
    assert np.array_equal(early.sums, alone.sums)
    # a large table: a small batch waits, the table's arrays untouched
    monkeypatch.setattr(DocumentSums, "_MIN_FOLD", 8)
    big = DocumentSums(np.arange(10_000, dtype=np.int64), np.ones((10_000, len(COLUMNS))))
    table = big._now[0]
    big.add_rows(np.array([3, 3, 20_000]), {"tokens": np.ones(3)})
    assert big._now[0] is table and big._now[3] == 2
    assert big.ids.size == 10_001 and big.sums[3, 0] == 3.0 and big.sums[-1, 0] == 1.0
    # ... and a long chain of small batches does not wait: _MAX_BLOCKS at the
    # most, or a quarter of the table's rows (folding costs the table)
    monkeypatch.setattr(DocumentSums, "_MAX_BLOCKS", 3)
    small = DocumentSums(np.arange(12, dtype=np.int64), np.ones((12, len(COLUMNS))))
    for i in range(2):
        small.add_rows(np.array([7]), {"tokens": np.ones(1)})
    assert small._now[2].depth == 2
    small.add_rows(np.array([7]), {"tokens": np.ones(1)})
    assert small._now[2] is None and small._now[1][7, 0] == 4.0
    table = big._folded()[0]
    for i in range(10_001 // 4 - 1):
        big.add_rows(np.array([7]), {"tokens": np.ones(1)})
    assert big._now[0] is table and big._now[2].depth == 2499
    big.add_rows(np.array([7]), {"tokens": np.ones(1)})
    assert big._now[2] is None and big._now[1][7, 0] == 2501.0


def test_document_sums_of_many_small_batches_pickle_and_copy():
    """An Evaluator given thousands of one-document batches (their sums
    waiting in a chain, one block nested in the next) pickles and copies
    (copy.deepcopy, copy.copy) with the sums it holds: the chain was past
    the recursion limit of pickle and deepcopy."""
    import copy
    import pickle

    rng = np.random.default_rng(2)
    z, t = rng.normal(size=(1, 3, 11)), rng.integers(0, 11, (1, 3))
    ev = lmmetrics.Evaluator()
    for i in range(3000):
        ev.update(z, t, document_ids=np.array([i - 1500]))
    others = [pickle.loads(pickle.dumps(ev)), copy.deepcopy(ev), copy.copy(ev)]  # (before a read folds them)
    want = ev.state_dict()
    for other in others:
        assert other.state_dict() == want
        other.update(z, t, document_ids=np.array([10**15]))  # (not in ev)
        assert ev.state_dict() == want and other.compute().per_document.ids[-1] == 10**15
