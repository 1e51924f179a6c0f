"""compare() against an independent float64 numpy implementation of the
llama.cpp KL-divergence statistics."""
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import log_softmax, random_logits


def sigma_of_mean(x):
    n = x.size
    v = np.var(x) / (n - 1)  # population variance / (n - 1)
    return math.sqrt(v) if v > 0 and n > 10 else 0.0


def percentile(x, p):
    s = np.sort(x)
    pos = p / 100 * (s.size - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, s.size - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def reference_stats(r, z, t):
    lr = log_softmax(r.astype(np.float64), -1).reshape(-1, r.shape[-1])
    lz = log_softmax(z.astype(np.float64), -1).reshape(-1, z.shape[-1])
    tf = t.reshape(-1)
    keep = tf >= 0
    lr, lz, tf = lr[keep], lz[keep], tf[keep]
    rows = np.arange(tf.size)
    nm, nr = -lz[rows, tf], -lr[rows, tf]
    kld = (np.exp(lr) * (lr - lz)).sum(-1)
    dp = np.exp(-nm) - np.exp(-nr)
    n = tf.size
    sm, sr = sigma_of_mean(nm), sigma_of_mean(nr)
    cov = np.mean((nm - nm.mean()) * (nr - nr.mean())) / (n - 1)
    ppl, pplr = math.exp(nm.mean()), math.exp(nr.mean())
    p_same = np.mean(lz.argmax(-1) == lr.argmax(-1))
    rms = math.sqrt(np.mean(dp ** 2))
    return {
        "ppl": (ppl, ppl * sm), "ppl_ref": (pplr, pplr * sr),
        "correlation": cov / (sm * sr),
        "ln_ratio": (nm.mean() - nr.mean(), math.sqrt(sm ** 2 + sr ** 2 - 2 * cov)),
        "ratio": (ppl / pplr, ppl / pplr * math.sqrt(sm ** 2 + sr ** 2 - 2 * cov)),
        "delta_ppl": (ppl - pplr, math.sqrt((ppl * sm) ** 2 + (pplr * sr) ** 2 - 2 * ppl * pplr * cov)),
        "kld": (kld.mean(), sigma_of_mean(kld)), "kld_values": kld,
        "delta_p": (dp.mean(), sigma_of_mean(dp)), "dp_values": dp,
        "rms_delta_p": (rms, 0.5 / rms * sigma_of_mean(dp ** 2)),
        "same_top": (p_same, math.sqrt(p_same * (1 - p_same) / (n - 1))),
        "tokens": n,
    }


def close(a, b, rel=1e-6, abs=1e-9):
    return a == pytest.approx(b, rel=rel, abs=abs)


@pytest.fixture(scope="module")
def pair():
    rng = np.random.default_rng(0)
    z = random_logits(rng, (6, 500, 2000), np.float32, scale=2.0)
    r = (z + rng.standard_normal(z.shape) * 0.4).astype(np.float32)
    t = rng.integers(0, 2000, (6, 500))
    t[:, :7] = -100
    return r, z, t


def test_compare_matches_independent_float64(pair):
    r, z, t = pair
    got = lmmetrics.compare(z, t, reference_logits=r)
    exp = reference_stats(r, z, t)
    assert got.tokens == exp["tokens"] == 6 * 493
    for k in ("ppl", "ppl_ref", "ln_ratio", "ratio", "delta_ppl", "rms_delta_p", "same_top"):
        e = getattr(got, k)
        assert close(e.value, exp[k][0]), k
        assert close(e.uncertainty, exp[k][1], rel=1e-5), k
    assert close(got.correlation, exp["correlation"])
    for name, vals in (("kld", "kld_values"), ("delta_p", "dp_values")):
        d = getattr(got, name)
        # per-token values from float32 logits: within 2e-6 of float64
        assert close(d.mean.value, exp[name][0], abs=1e-7), name
        assert close(d.mean.uncertainty, exp[name][1], rel=1e-3, abs=1e-8), name
        x = exp[vals]
        assert close(d.max, x.max(), abs=2e-6) and close(d.min, x.min(), abs=2e-6)
        assert close(d.median, percentile(x, 50), abs=2e-6)
        for p, v in d.percentiles.items():
            assert close(v, percentile(x, p), abs=2e-6), (name, p)
    assert set(got.kld.percentiles) == {99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1}
    assert set(got.delta_p.percentiles) == {99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1}


def test_compare_output(pair):
    r, z, t = pair
    c = lmmetrics.compare(z, t, reference_logits=r)
    text = str(c)
    for line in ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean    KLD",
                 "99.9%   KLD", "Median  KLD", "Minimum KLD", "RMS Δp", "Same top p"):
        assert line in text, line
    d = json.loads(json.dumps(c.as_dict()))
    assert d["kld"]["percentiles"]["99.9%"] == pytest.approx(c.kld.percentiles[99.9])
    assert d["ppl"]["value"] == pytest.approx(c.ppl.value)


def test_compare_identical_models():
    rng = np.random.default_rng(1)
    z = random_logits(rng, (40, 300), np.float32)
    t = rng.integers(0, 300, 40)
    c = lmmetrics.compare(z, t, reference_logits=z)
    assert c.kld.max < 1e-6 and c.same_top.value == 1.0 and c.same_top.uncertainty == 0.0
    assert c.ratio.value == pytest.approx(1.0) and c.delta_ppl.value == pytest.approx(0.0, abs=1e-9)
    assert c.rms_delta_p.value == pytest.approx(0.0, abs=1e-7)


def test_compare_few_tokens_have_no_uncertainty():
    rng = np.random.default_rng(2)
    z = random_logits(rng, (5, 30), np.float32)
    r = random_logits(rng, (5, 30), np.float32)
    c = lmmetrics.compare(z, rng.integers(0, 30, 5), reference_logits=r)
    assert c.tokens == 5 and c.ppl.uncertainty == 0.0 and c.kld.mean.uncertainty == 0.0


def test_compare_errors():
    z = np.zeros((3, 10), np.float32)
    with pytest.raises(ValueError, match="no counted token"):
        lmmetrics.compare(z, np.full(3, -100), reference_logits=z)
    with pytest.raises(ValueError, match="shape"):
        lmmetrics.compare(z, np.zeros(3, np.int64), reference_logits=z[:2])


def test_few_tokens_follow_llama_cpp():
    """llama.cpp gives no uncertainty on 10 tokens or fewer, and no
    covariance below 10 (its mean_and_uncertainty and covariance): the
    ln(PPL ratio), ratio and PPL difference have no uncertainty either,
    where a covariance alone made one up (±0.408 on 5 tokens)."""
    rng = np.random.default_rng(3)
    for n in range(2, 11):
        for seed in range(5):
            z = random_logits(rng, (n, 30), np.float32)
            r = random_logits(rng, (n, 30), np.float32)
            c = lmmetrics.compare(z, rng.integers(0, 30, n), reference_logits=r)
            assert c.tokens == n
            assert c.ppl.uncertainty == c.ppl_ref.uncertainty == 0.0
            if n < 10:
                assert c.ln_ratio.uncertainty == c.ratio.uncertainty == c.delta_ppl.uncertainty == 0.0


# llama.cpp's printf formats (tools/perplexity/perplexity.cpp, kl_divergence()),
# copied as written there, for a byte-for-byte check
LLAMA_FORMATS = r"""====== Perplexity statistics ======
Mean PPL(Q)                   : %10.6lf ± %10.6lf
Mean PPL(base)                : %10.6lf ± %10.6lf
Cor(ln(PPL(Q)), ln(PPL(base))): %6.2lf%%
Mean ln(PPL(Q)/PPL(base))     : %10.6lf ± %10.6lf
Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf
Mean PPL(Q)-PPL(base)         : %10.6lf ± %10.6lf

====== KL divergence statistics ======
Mean    KLD: %10.6lf ± %10.6lf
Maximum KLD: %10.6f
99.9%%   KLD: %10.6f
99.0%%   KLD: %10.6f
95.0%%   KLD: %10.6f
90.0%%   KLD: %10.6f
Median  KLD: %10.6f
10.0%%   KLD: %10.6f
 5.0%%   KLD: %10.6f
 1.0%%   KLD: %10.6f
 0.1%%   KLD: %10.6f
Minimum KLD: %10.6f

====== Token probability statistics ======
Mean    Δp: %6.3lf ± %5.3lf %%
Maximum Δp: %6.3lf%%
99.9%%   Δp: %6.3lf%%
99.0%%   Δp: %6.3lf%%
95.0%%   Δp: %6.3lf%%
90.0%%   Δp: %6.3lf%%
75.0%%   Δp: %6.3lf%%
Median  Δp: %6.3lf%%
25.0%%   Δp: %6.3lf%%
10.0%%   Δp: %6.3lf%%
 5.0%%   Δp: %6.3lf%%
 1.0%%   Δp: %6.3lf%%
 0.1%%   Δp: %6.3lf%%
Minimum Δp: %6.3lf%%
RMS Δp    : %6.3lf ± %5.3lf %%
Same top p: %6.3lf ± %5.3lf %%
"""


def llama_text(c):
    """The statistics printed through llama.cpp's own formats."""
    k, dp = c.kld, c.delta_p
    values = [c.ppl.value, c.ppl.uncertainty, c.ppl_ref.value, c.ppl_ref.uncertainty, 100 * c.correlation,
              c.ln_ratio.value, c.ln_ratio.uncertainty, c.ratio.value, c.ratio.uncertainty,
              c.delta_ppl.value, c.delta_ppl.uncertainty, k.mean.value, k.mean.uncertainty, k.max]
    values += [k.percentiles[p] for p in (99.9, 99.0, 95.0, 90.0)] + [k.median]
    values += [k.percentiles[p] for p in (10.0, 5.0, 1.0, 0.1)] + [k.min]
    values += [100 * dp.mean.value, 100 * dp.mean.uncertainty, 100 * dp.max]
    values += [100 * dp.percentiles[p] for p in (99.9, 99.0, 95.0, 90.0, 75.0)] + [100 * dp.median]
    values += [100 * dp.percentiles[p] for p in (25.0, 10.0, 5.0, 1.0, 0.1)] + [100 * dp.min]
    values += [100 * c.rms_delta_p.value, 100 * c.rms_delta_p.uncertainty,
               100 * c.same_top.value, 100 * c.same_top.uncertainty]
    return LLAMA_FORMATS.replace("lf", "f") % tuple(values)


def test_llama_cpp_format_byte_for_byte(pair):
    r, z, t = pair
    c = lmmetrics.compare(z, t, reference_logits=r)
    assert c.llama_cpp() + "\n" == llama_text(c)
    # the default table: the same lines, units where a value has one, and the token count
    lines = str(c).splitlines()
    assert lines[:-1] != llama_text(c).splitlines()
    assert [x.removesuffix(" nats") for x in lines[:-1]] == llama_text(c).splitlines()
    assert lines[-1] == f"Tokens    : {c.tokens}"
    assert all(x.endswith(" nats") for x in lines if "KLD:" in x or x.startswith("Mean ln("))
