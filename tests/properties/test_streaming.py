"""Evaluator streamed, merged and restored against a float64 reference
written token by token from docs/formulas.md and docs/guides/uncertainty.md
(hypothesis): random batch splits and orders, documents spanning batches,
documents and batches with no counted token, one-token documents, zero-byte
tokens, a positive ignore_index, shift=True with documents, reference logits
on some batches only, ruled-out targets (inf NLL), top_k and calibration."""
import json
import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lmmetrics  # noqa: E402

LN2 = math.log(2.0)


def _log_softmax(z):
    m = z.max()
    return z - (m + math.log(np.sum(np.exp(z - m))))


def _se(x):
    """The sample standard deviation over sqrt(n); nan below two, inf with an inf."""
    x = np.asarray(x, float)
    if x.size < 2:
        return math.nan
    return math.inf if np.isinf(x).any() else float(np.std(x, ddof=1) / math.sqrt(x.size))


def _clustered(s, c):
    """sqrt(G / (G - 1) sum_g (s_g - mean c_g)^2) / N over the documents with c_g > 0."""
    s, c = np.asarray(s, float)[np.asarray(c) > 0], np.asarray(c, float)[np.asarray(c) > 0]
    if c.size < 2:
        return math.nan
    if not np.isfinite(s).all():
        return math.inf
    mean = s.sum() / c.sum()
    return math.sqrt(c.size / (c.size - 1) * np.sum((s - mean * c) ** 2)) / c.sum()


def _rows(batches, ignore_index, shift, token_bytes):
    """One dict per position of every batch (None where not counted)."""
    out = []
    for b in batches:
        z, t, r, d = b["z"], b["t"], b.get("r"), b.get("d")
        if d is not None:
            d = np.asarray(d)
            d = d if d.shape == t.shape else np.broadcast_to(d.reshape(d.shape + (1,) * (t.ndim - d.ndim)), t.shape)
        if shift:
            z, t = z[:, :-1], t[:, 1:]
            r = None if r is None else r[:, :-1]
            d = None if d is None else d[:, 1:]
        V = z.shape[-1]
        z, t = z.reshape(-1, V), t.reshape(-1)
        r = None if r is None else r.reshape(-1, V)
        d = None if d is None else d.reshape(-1)
        for i, y in enumerate(t):
            if y < 0 or y == ignore_index:
                out.append(None)
                continue
            with np.errstate(divide="ignore", invalid="ignore"):
                lz = _log_softmax(z[i])
                p = np.exp(lz)
                row = dict(nll=-lz[y], ent=-np.sum(np.where(p > 0, p * lz, 0.0)),
                           correct=float(np.argmax(z[i]) == y),
                           rank=int(np.sum(z[i] > z[i, y]) + np.sum(z[i, :y] == z[i, y])),
                           # (the top probability as 1 / sum e^(z - max): exactly 1/k for k tied
                           # tokens, which exp(-log k) gives a few ulps low, the bin below an edge)
                           conf=1.0 / np.sum(np.exp(z[i] - z[i].max())),
                           doc=None if d is None else int(d[i]), b=0.0 if token_bytes is None else token_bytes[y])
                if r is not None:
                    lr = _log_softmax(r[i])
                    pr = np.exp(lr)
                    row.update(kl=np.sum(np.where(pr > 0, pr * (lr - lz), 0.0)), ref_nll=-lr[y],
                               same=float(np.argmax(z[i]) == np.argmax(r[i])))
            out.append(row)
    return out


def reference(batches, *, ignore_index, shift, token_bytes, nll_only, top_k, bins):
    """What compute() should give, by name (stderr as se_<name>, stderr_documents as sd_<name>)."""
    all_rows = _rows(batches, ignore_index, shift, token_bytes)
    rows = [x for x in all_rows if x is not None]
    n = len(rows)
    nll = np.array([x["nll"] for x in rows])
    want = dict(tokens=n, ignored=len(all_rows) - n, nll_sum=nll.sum(), loss=nll.mean() if n else math.nan,
                se_loss=_se(nll))
    if not nll_only:
        for name, key in (("accuracy", "correct"), ("entropy", "ent")):
            v = [x[key] for x in rows]
            want[name], want["se_" + name] = (np.mean(v) if n else math.nan), _se(v)
    if token_bytes is not None:
        b = np.array([x["b"] for x in rows], float)
        xb = np.where(b > 0, nll, 0.0)
        want["bytes"] = int(b.sum())
        want["bits_per_byte"] = xb.sum() / (LN2 * b.sum()) if b.sum() else math.inf
        want["se_bits_per_byte"] = math.nan
        if n >= 2 and b.sum():  # the delta method: sqrt(n / (n - 1) sum (x - R b)^2) / sum b
            ratio = xb.sum() / b.sum()
            want["se_bits_per_byte"] = (math.inf if np.isinf(xb).any() else
                                        math.sqrt(n / (n - 1) * np.sum((xb - ratio * b) ** 2)) / b.sum() / LN2)
    paired = [x for x in rows if "kl" in x]
    want["kl"] = None
    if paired:
        with np.errstate(invalid="ignore"):  # inf - inf: both rule the target out (the mean is then nan)
            diff = [x["nll"] - x["ref_nll"] for x in paired]
        want.update(kl=np.mean([x["kl"] for x in paired]), se_kl=_se([x["kl"] for x in paired]),
                    same_top=np.mean([x["same"] for x in paired]),
                    loss_ref=np.mean([x["ref_nll"] for x in paired]))
        if np.isfinite(diff).all():
            want.update(loss_diff=np.mean(diff), se_loss_diff=_se(diff))
    if top_k:
        ranks = np.array([x["rank"] for x in rows])
        want["top_k"] = {k: np.mean(ranks < k) if n else math.nan for k in top_k}
        want["mean_reciprocal_rank"] = np.mean(1.0 / (ranks + 1)) if n else math.nan
    if bins:
        conf, ok = np.array([x["conf"] for x in rows]), np.array([x["correct"] for x in rows])
        which = np.minimum((conf * bins).astype(int), bins - 1)
        want["ece"] = sum((which == k).sum() / n * abs(ok[which == k].mean() - conf[which == k].mean())
                          for k in range(bins) if (which == k).any()) if n else math.nan
    if all_rows and batches[0].get("d") is not None:
        ids = sorted({x["doc"] for x in rows})
        by = [[x for x in rows if x["doc"] == d] for d in ids]
        loss = np.array([np.mean([x["nll"] for x in g]) for g in by])
        want.update(documents=len(ids), macro_loss=loss.mean() if ids else math.nan, se_macro_loss=_se(loss),
                    sd_loss=_clustered([sum(x["nll"] for x in g) for g in by], [len(g) for g in by]))
        if ids:
            with np.errstate(over="ignore"):
                want.update(mean_perplexity=np.exp(loss).mean(), se_mean_perplexity=_se(np.exp(loss)))
        if not nll_only and ids:
            for name, key in (("accuracy", "correct"), ("entropy", "ent")):
                want["macro_" + name] = np.mean([np.mean([x[key] for x in g]) for g in by])
                want["sd_" + name] = _clustered([sum(x[key] for x in g) for g in by], [len(g) for g in by])
        if token_bytes is not None:
            sb = [(sum(x["nll"] for x in g if x["b"] > 0), sum(x["b"] for x in g)) for g in by]
            per = [s / (c * LN2) for s, c in sb if c > 0]
            want["macro_bits_per_byte"] = float(np.mean(per)) if per else math.nan
            want["sd_bits_per_byte"] = _clustered([s for s, _ in sb], [c for _, c in sb]) / LN2
        if paired:
            kl = [[x["kl"] for x in g if "kl" in x] for g in by]
            want["macro_kl"] = float(np.mean([np.mean(k) for k in kl if k]))
            want["sd_kl"] = _clustered([sum(k) for k in kl], [len(k) for k in kl])
    return want


def _check(m, want):
    got = dict(tokens=m.tokens, ignored=m.ignored, nll_sum=m.nll_sum, loss=m.loss, accuracy=m.accuracy,
               entropy=m.entropy, bytes=m.bytes, bits_per_byte=m.bits_per_byte, kl=m.kl, same_top=m.same_top,
               loss_ref=m.loss_ref, loss_diff=m.loss_diff, mean_reciprocal_rank=m.mean_reciprocal_rank,
               ece=m.ece, documents=m.documents, macro_loss=m.macro_loss, mean_perplexity=m.mean_perplexity,
               macro_accuracy=m.macro_accuracy, macro_entropy=m.macro_entropy,
               macro_bits_per_byte=m.macro_bits_per_byte, macro_kl=m.macro_kl)
    got.update({"se_" + k: v for k, v in m.stderr.items()})
    got.update({"sd_" + k: v for k, v in m.stderr_documents.items()})
    for name, w in want.items():
        g = m.top_k_accuracy if name == "top_k" else got[name]
        if name == "top_k":
            assert g.keys() == w.keys() and all(math.isclose(g[k], w[k]) or g[k] == w[k] or math.isnan(w[k])
                                                  for k in w), (name, g, w)
            continue
        if w is None or g is None:
            assert g is w, (name, g, w)
        elif math.isnan(w):
            assert math.isnan(g), (name, g, w)
        elif math.isinf(w) or math.isinf(g):
            assert g == w, (name, g, w)
        else:
            # a standard error from float64 sums of squares: within ~sqrt(eps) of its mean's scale
            tol = 1e-6 if name.startswith(("se_", "sd_")) else 1e-9
            assert math.isclose(g, w, rel_tol=1e-9, abs_tol=tol), (name, g, w)


@st.composite
def scenarios(draw):
    V = draw(st.integers(2, 9))
    shift = draw(st.booleans())
    docs = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batches = []
    for _ in range(draw(st.integers(1, 5))):
        B, T = draw(st.integers(1, 3)), draw(st.integers(1 + shift, 5))
        z = rng.standard_normal((B, T, V)) * draw(st.sampled_from([0.1, 2.0, 8.0]))
        if draw(st.booleans()):
            z = np.round(z)  # ties: the lowest index wins
        if draw(st.integers(0, 3)) == 0:  # ruled-out entries (never a whole row)
            out = rng.random(z.shape) < 0.3
            out[..., 0] = False
            z = np.where(out, -np.inf, z)
        t = rng.integers(0, V, (B, T))
        ignored = draw(st.sampled_from(["none", "some", "all"]))
        if ignored == "some":
            t[rng.random((B, T)) < 0.3] = rng.choice([-100, -1, 3 % V])
        elif ignored == "all":
            t[:] = -100
        b = dict(z=z, t=t)
        if draw(st.booleans()):
            b["r"] = z + rng.standard_normal(z.shape)
        if docs:
            b["d"] = draw(st.sampled_from([lambda: rng.integers(0, 4, (B, T)), lambda: rng.integers(0, 4, B),
                                           lambda: int(rng.integers(0, 4))]))()
        batches.append(b)
    table = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=V, max_size=V)))
    settings_ = dict(ignore_index=draw(st.sampled_from([-100, None, 3])), shift=shift,
                     token_bytes=None if table is None else np.array(table), nll_only=draw(st.booleans()),
                     top_k=draw(st.one_of(st.none(), st.lists(st.integers(1, 2), min_size=1, max_size=2))),
                     calibration_bins=draw(st.one_of(st.none(), st.integers(1, 7))))
    return settings_, batches


def _fed(kw, batches):
    ev = lmmetrics.Evaluator(**kw)
    for b in batches:
        ev.update(b["z"], b["t"], reference_logits=b.get("r"), document_ids=b.get("d"))
    return ev


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_streamed_merged_and_restored_give_the_reference(scenario, rnd):
    kw, batches = scenario
    want = reference(batches, ignore_index=kw["ignore_index"], shift=kw["shift"], token_bytes=kw["token_bytes"],
                     nll_only=kw["nll_only"], top_k=sorted(set(kw["top_k"] or [])), bins=kw["calibration_bins"])
    order = list(batches)
    rnd.shuffle(order)
    with np.errstate(invalid="raise"):  # no NaN made on the way (inf * 0 in a sum)
        ev = _fed(kw, order)
        cut = rnd.randint(0, len(order))
        merged = _fed(kw, order[:cut]).merge(_fed(kw, order[cut:]))
    _check(ev.compute(), want)
    _check(merged.compute(), want)
    restored = lmmetrics.Evaluator(**kw)
    restored.load_state_dict(json.loads(json.dumps(ev.state_dict())))
    _check(restored.compute(), want)
    if len(batches) == 1 and not kw["nll_only"]:
        b = batches[0]
        _check(lmmetrics.evaluate(b["z"], b["t"], reference_logits=b.get("r"), document_ids=b.get("d"),
                                  **{k: v for k, v in kw.items() if k != "nll_only"}), want)
