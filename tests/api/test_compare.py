"""compare() against an independent float64 numpy implementation of the
llama.cpp KL-divergence statistics."""
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import X86_64, llama_text, log_softmax, random_logits


def sigma_of_mean(x):
    n = x.size
    with np.errstate(invalid="ignore"):  # (inf - inf: an infinite value's variance is NaN here)
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



@pytest.mark.parametrize("eps", [1e-8, 1e-6, 1e-3])
def test_paired_uncertainties_of_models_that_nearly_agree(eps):
    """The ln(PPL ratio), ratio and PPL-difference uncertainties are the
    spread of the paired differences, computed from them (llama.cpp's
    s_m^2 + s_r^2 - 2 cov in exact arithmetic): of float64 logits 1e-8
    apart, that difference of near-equal terms gave 2.63e-9 for the ln
    ratio where the paired differences give 1.73e-10 (15 times), and 9.16e-5
    for the PPL difference where they give 6.01e-6; at 1e-6 apart, 0.7% off."""
    rng = np.random.default_rng(5)
    r = random_logits(rng, (4000, 500), np.float64)
    z = r + rng.standard_normal(r.shape) * eps
    t = rng.integers(0, 500, 4000)
    c = lmmetrics.compare(z, t, reference_logits=r)
    rows = np.arange(t.size)
    nm, nr = -log_softmax(z)[rows, t], -log_softmax(r)[rows, t]
    n = t.size
    ppl, pplr = math.exp(nm.mean()), math.exp(nr.mean())
    ln_unc = math.sqrt(np.var(nm - nr) / (n - 1))
    assert c.ln_ratio.uncertainty == pytest.approx(ln_unc, rel=1e-6, abs=0)
    assert c.ratio.uncertainty == pytest.approx(ppl / pplr * ln_unc, rel=1e-6, abs=0)
    diff_unc = math.sqrt(np.var(ppl * nm - pplr * nr) / (n - 1))
    assert c.delta_ppl.uncertainty == pytest.approx(diff_unc, rel=1e-6, abs=0)



def test_an_estimate_prints_its_significant_digits():
    """str() of an Estimate keeps six significant digits of the value and two
    of the uncertainty, as Metrics does: a mean KL of 3.2e-7 printed as
    "0.000000 ± 0.000000", an exact-looking 0."""
    rng = np.random.default_rng(6)
    r = random_logits(rng, (200, 50), np.float64)
    z = r + rng.standard_normal(r.shape) * 1e-3
    t = rng.integers(0, 50, 200)
    c = lmmetrics.compare(z, t, reference_logits=r)
    kl = (np.exp(log_softmax(r)) * (log_softmax(r) - log_softmax(z))).sum(-1)
    assert 1e-7 < kl.mean() < 1e-6
    assert str(c.kld.mean) == f"{kl.mean():.6g} ± {math.sqrt(np.var(kl) / (kl.size - 1)):.2g}"
    assert str(lmmetrics.Estimate(3.2e-7, 4.1e-8)) == "3.2e-07 ± 4.1e-08"
    assert str(lmmetrics.Estimate(52.914287, 2.765294)) == "52.9143 ± 2.8"


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
    where a covariance alone made one up (±0.408 on 5 tokens; on exactly
    10, llama.cpp's sqrt(-2 cov): -nan, or a number with a negative
    covariance, which only llama_cpp() prints)."""
    rng = np.random.default_rng(3)
    for n in range(2, 11):
        for seed in range(5):
            z = random_logits(rng, (n, 30), np.float32)
            r = random_logits(rng, (n, 30), np.float32)
            c = lmmetrics.compare(z, rng.integers(0, 30, n), reference_logits=r)
            assert c.tokens == n
            assert c.ppl.uncertainty == c.ppl_ref.uncertainty == 0.0
            assert c.ln_ratio.uncertainty == c.ratio.uncertainty == c.delta_ppl.uncertainty == 0.0


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


# ---------------------------------------------------------------------------
# Where llama.cpp prints -nan or inf: its kl_divergence() (tools/perplexity/
# perplexity.cpp) computed by a C program with its formulas and its printf
# lines, fed the same per-token values; the sums are exact (NLLs on a grid of
# 1/8 or 1/16), so that only the arithmetic after them is compared.

LLAMA_HARNESS = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
typedef struct { double f, df; } pair;
static pair mean_and_uncertainty(double sum, double sum2, size_t count) {
    pair r = {0., 0.};
    if (count < 1) return r;
    double f = sum/count;
    double df = sum2/count - f*f;
    df = df > 0 && count > 10 ? sqrt(df/(count-1)) : 0.;
    r.f = f; r.df = df;
    return r;
}
static double covariance(double suma, double sumb, double sumab, size_t count) {
    if (count < 10) return 0.0;
    double var = sumab/count - (suma/count)*(sumb/count);
    var /= count - 1;
    return var;
}
static int by_value(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
/* its percentile lambda and median, on the values stored as float and sorted */
static float percentile(const float *values, size_t n, float fraction) {
    if (fraction <= 0) return values[0];
    if (fraction >= 1) return values[n - 1];
    float p = fraction*(n - 1);
    size_t ip = (size_t)p; p -= ip;
    return (1 - p)*values[ip] + p*values[ip + 1 < n - 1 ? ip + 1 : n - 1];
}
static float median(const float *values, size_t n) {
    return n%2 == 0 ? 0.5f*(values[n/2] + values[n/2 - 1]) : values[n/2];
}
int main(void) {
    size_t count, n_same;
    double sum_nll = 0, sum_nll2 = 0, sum_nll_base = 0, sum_nll_base2 = 0, sum_nll_nll_base = 0;
    double sum_kld = 0, sum_kld2 = 0, sum_p_diff = 0, sum_p_diff2 = 0, sum_p_diff4 = 0;
    if (scanf("%zu %zu", &count, &n_same) != 2) return 1;
    float *kld_values = malloc(count*sizeof(float)), *p_diff_values = malloc(count*sizeof(float));
    for (size_t i = 0; i < count; ++i) {
        double nll, nll_base, kld, p_diff;
        if (scanf("%la %la %la %la", &nll, &nll_base, &kld, &p_diff) != 4) return 1;
        kld_values[i] = (float)kld; p_diff_values[i] = (float)p_diff;
        sum_nll += nll; sum_nll2 += nll*nll;
        sum_nll_base += nll_base; sum_nll_base2 += nll_base*nll_base;
        sum_nll_nll_base += nll*nll_base;
        sum_kld += kld; sum_kld2 += kld*kld;
        sum_p_diff += p_diff;
        const double p_diff2 = p_diff*p_diff;
        sum_p_diff2 += p_diff2; sum_p_diff4 += p_diff2*p_diff2;
    }
    pair log_ppl = mean_and_uncertainty(sum_nll, sum_nll2, count);
    const double ppl_val = exp(log_ppl.f);
    const double ppl_unc = ppl_val * log_ppl.df;
    printf("Mean PPL(Q)                   : %10.6lf ± %10.6lf\n", ppl_val, ppl_unc);
    pair log_ppl_base = mean_and_uncertainty(sum_nll_base, sum_nll_base2, count);
    const double ppl_base_val = exp(log_ppl_base.f);
    const double ppl_base_unc = ppl_base_val * log_ppl_base.df;
    printf("Mean PPL(base)                : %10.6lf ± %10.6lf\n", ppl_base_val, ppl_base_unc);
    const double log_ppl_cov = covariance(sum_nll, sum_nll_base, sum_nll_nll_base, count);
    const double log_ppl_cor = log_ppl_cov / (log_ppl.df*log_ppl_base.df);
    printf("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2lf%%\n", 100.0*log_ppl_cor);
    const double log_ppl_ratio_val = log_ppl.f - log_ppl_base.f;
    const double log_ppl_ratio_unc = sqrt(log_ppl.df*log_ppl.df + log_ppl_base.df*log_ppl_base.df - 2.0*log_ppl_cov);
    printf("Mean ln(PPL(Q)/PPL(base))     : %10.6lf ± %10.6lf\n", log_ppl_ratio_val, log_ppl_ratio_unc);
    const double ppl_ratio_val = exp(log_ppl_ratio_val);
    const double ppl_ratio_unc = ppl_ratio_val * log_ppl_ratio_unc;
    printf("Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf\n", ppl_ratio_val, ppl_ratio_unc);
    const double ppl_cov = ppl_val * ppl_base_val * log_ppl_cov;
    const double ppl_diff_val = ppl_val - ppl_base_val;
    const double ppl_diff_unc = sqrt(ppl_unc*ppl_unc + ppl_base_unc*ppl_base_unc - 2.0*ppl_cov);
    printf("Mean PPL(Q)-PPL(base)         : %10.6lf ± %10.6lf\n", ppl_diff_val, ppl_diff_unc);
    pair kl_div = mean_and_uncertainty(sum_kld, sum_kld2, count);
    printf("Mean    KLD: %10.6lf ± %10.6lf\n", kl_div.f, kl_div.df);
    qsort(kld_values, count, sizeof(float), by_value);
    qsort(p_diff_values, count, sizeof(float), by_value);
    const float fk[] = {0.999f, 0.990f, 0.950f, 0.900f}, fk_low[] = {0.100f, 0.050f, 0.010f, 0.001f};
    const char *lk[] = {"99.9", "99.0", "95.0", "90.0"}, *lk_low[] = {"10.0", " 5.0", " 1.0", " 0.1"};
    printf("Maximum KLD: %10.6f\n", kld_values[count - 1]);
    for (int j = 0; j < 4; ++j) printf("%s%%   KLD: %10.6f\n", lk[j], percentile(kld_values, count, fk[j]));
    printf("Median  KLD: %10.6f\n", median(kld_values, count));
    for (int j = 0; j < 4; ++j) printf("%s%%   KLD: %10.6f\n", lk_low[j], percentile(kld_values, count, fk_low[j]));
    printf("Minimum KLD: %10.6f\n", kld_values[0]);
    pair p_diff = mean_and_uncertainty(sum_p_diff, sum_p_diff2, count);
    printf("Mean    Δp: %6.3lf ± %5.3lf %%\n",  100.0*p_diff.f, 100.0*p_diff.df);
    const float fp[] = {0.999f, 0.990f, 0.950f, 0.900f, 0.750f}, fp_low[] = {0.250f, 0.100f, 0.050f, 0.010f, 0.001f};
    const char *lp[] = {"99.9", "99.0", "95.0", "90.0", "75.0"}, *lp_low[] = {"25.0", "10.0", " 5.0", " 1.0", " 0.1"};
    printf("Maximum Δp: %6.3lf%%\n", 100.0*p_diff_values[count - 1]);
    for (int j = 0; j < 5; ++j) printf("%s%%   Δp: %6.3lf%%\n", lp[j], 100.0*percentile(p_diff_values, count, fp[j]));
    printf("Median  Δp: %6.3lf%%\n", 100.0*median(p_diff_values, count));
    for (int j = 0; j < 5; ++j) printf("%s%%   Δp: %6.3lf%%\n", lp_low[j], 100.0*percentile(p_diff_values, count, fp_low[j]));
    printf("Minimum Δp: %6.3lf%%\n", 100.0*p_diff_values[0]);
    pair p_diff_mse = mean_and_uncertainty(sum_p_diff2, sum_p_diff4, count);
    const double p_diff_rms_val = sqrt(p_diff_mse.f);
    const double p_diff_rms_unc = 0.5/p_diff_rms_val * p_diff_mse.df;
    printf("RMS Δp    : %6.3lf ± %5.3lf %%\n", 100.0*p_diff_rms_val, 100.0*p_diff_rms_unc);
    const double same_top_p = 1.0*n_same/count;
    printf("Same top p: %6.3lf ± %5.3lf %%\n", 100.0*same_top_p,
           100.0*sqrt(same_top_p*(1.0 - same_top_p)/(count - 1)));
    return 0;
}
"""


@pytest.fixture(scope="module")
def llama_harness(tmp_path_factory):
    import shutil
    import subprocess
    import sysconfig

    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for the llama.cpp harness")
    d = tmp_path_factory.mktemp("llama_harness")
    (d / "h.c").write_text(LLAMA_HARNESS)
    # no fused multiply-adds: IEEE double operation by operation, as lmmetrics computes
    subprocess.run([cc, "-O2", "-std=c99", "-ffp-contract=off", "-o", str(d / "h"), str(d / "h.c"), "-lm"],
                   check=True, capture_output=True)

    def run(nll_m, nll_r, kld, same):
        dp = np.exp(-nll_m) - np.exp(-nll_r)
        rows = [f"{nll_m.size} {int(np.count_nonzero(same))}"]
        rows += [" ".join(float(x).hex() for x in row) for row in zip(nll_m, nll_r, kld, dp)]
        return subprocess.run([str(d / "h")], input="\n".join(rows) + "\n", capture_output=True, text=True,
                              check=True).stdout.splitlines()

    return run


def _degenerate_case(name):
    """(nll_m, nll_r, kld, same) on a grid of 1/8 and 1/16: exact sums in
    any order."""
    if name == "identical":  # the model is its reference
        m = (np.arange(200) % 14) / 8
        return m, m.copy(), np.zeros(200), np.ones(200, bool)
    n = int(name.split()[0])
    i = np.arange(n)
    m = (i % 7) / 8 + 1
    r = 3 - m if "anti" in name else m / 2 + (i % 3) / 16 + 0.5  # a covariance below 0, or above
    return m, r, (i % 5) / 16, i % 2 == 0


DEGENERATE = ["identical", "10 tokens", "10 tokens anti", "9 tokens", "5 tokens", "11 tokens", "1 token",
              "2 tokens"]


@pytest.mark.parametrize("name", DEGENERATE)
def test_llama_cpp_arithmetic_against_its_c_code(llama_harness, name):
    m, r, k, same = _degenerate_case(name)
    c = lmmetrics.comparison.comparison_from_tokens(m, r, k, same)
    want = llama_harness(m, r, k, same)
    labels = {w.split(":")[0] for w in want}
    got = [line for line in c.llama_cpp().splitlines() if line.split(":")[0] in labels]
    assert got == want


@pytest.mark.skipif(not X86_64, reason="llama.cpp's -nan is x86-64's default NaN (other processors: nan)")
def test_llama_cpp_prints_its_nan_and_inf():
    """The lines llama.cpp prints on x86-64 with glibc, as its formulas give
    them; the table and as_dict give 0 (and NaN for the correlation)."""
    c = lmmetrics.comparison.comparison_from_tokens(*_degenerate_case("identical"))
    text = c.llama_cpp().splitlines()
    assert "Mean ln(PPL(Q)/PPL(base))     :   0.000000 ±       -nan" in text  # sqrt of -2e-19
    assert "Mean PPL(Q)/PPL(base)         :   1.000000 ±       -nan" in text
    assert "RMS Δp    :  0.000 ±  -nan %" in text  # 0.5 / 0 * 0
    assert "Cor(ln(PPL(Q)), ln(PPL(base))): 100.00%" in text
    assert c.ln_ratio.uncertainty == c.ratio.uncertainty == c.rms_delta_p.uncertainty == 0.0
    assert "RMS Δp    :  0.000 ± 0.000 %" in str(c)
    c = lmmetrics.comparison.comparison_from_tokens(*_degenerate_case("10 tokens"))
    text = c.llama_cpp().splitlines()
    assert "Cor(ln(PPL(Q)), ln(PPL(base))):    inf%" in text  # a covariance over sigmas of 0
    assert "Mean ln(PPL(Q)/PPL(base))     :   0.093750 ±       -nan" in text  # sqrt(-2 cov)
    assert "Mean PPL(Q)-PPL(base)         :   0.328364 ±       -nan" in text
    assert math.isnan(c.correlation) and c.ln_ratio.uncertainty == c.delta_ppl.uncertainty == 0.0
    c = lmmetrics.comparison.comparison_from_tokens(*_degenerate_case("5 tokens"))
    assert "Cor(ln(PPL(Q)), ln(PPL(base))):   -nan%" in c.llama_cpp().splitlines()  # 0 / 0
    assert "Cor(ln(PPL(Q)), ln(PPL(base))):    nan%" in str(c).splitlines()
    c = lmmetrics.comparison.comparison_from_tokens(*_degenerate_case("1 token"))
    assert c.llama_cpp().splitlines()[-1] == "Same top p: 100.000 ±  -nan %"  # 0 / 0
    assert c.same_top.uncertainty == 0.0


def test_a_token_the_model_rules_out():
    """Where the model gives -inf to a token the reference gives mass to, that
    token's KL is infinite: the mean and the percentiles interpolated towards
    it are inf (numpy's quantile gave NaN: inf - inf), the others float64's,
    and an infinite value's uncertainty is inf, as evaluate()'s is; a target
    ruled out makes the perplexity and its ratio infinite likewise. No NaN
    and no warning; llama_cpp() keeps llama.cpp's own arithmetic."""
    import warnings

    rng = np.random.default_rng(4)
    r = random_logits(rng, (40, 16), np.float32)
    z = (r + rng.standard_normal(r.shape) * 0.3).astype(np.float32)
    t = rng.integers(0, 16, 40)
    z[[7, 21], 3] = -np.inf                 # two tokens of infinite KL (targets elsewhere)
    t[[7, 21]] = 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = lmmetrics.compare(z, t, reference_logits=r)
    exp = reference_stats(r, z, t)
    kl = np.sort(exp["kld_values"])
    assert np.isinf(kl[-2:]).all() and np.isfinite(kl[:-2]).all()
    for p, v in c.kld.percentiles.items():
        pos = p / 100 * (kl.size - 1)
        if math.ceil(pos) >= kl.size - 2:   # interpolated towards an infinite KL
            assert v == math.inf, p
        else:
            assert close(v, np.quantile(kl[:-2], pos / (kl.size - 3)), abs=2e-6), p
    assert c.kld.max == c.kld.mean.value == c.kld.mean.uncertainty == math.inf
    assert math.isfinite(c.ppl.value) and close(c.ppl.value, exp["ppl"][0])   # the targets keep their mass
    assert "Mean    KLD:        inf ±   0.000000" in c.llama_cpp().splitlines()
    assert "Mean    KLD:        inf ±        inf nats" in str(c).splitlines()
    assert "nan" not in str(c).replace("Cor(ln(PPL(Q)), ln(PPL(base))):    nan%", "")
    t[11] = 3
    z[11, 3] = -np.inf                      # a target ruled out: the model's NLL is infinite there
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = lmmetrics.compare(z, t, reference_logits=r)
    for e in (c.ppl, c.ln_ratio, c.ratio, c.delta_ppl, c.kld.mean):
        assert e.value == e.uncertainty == math.inf
    assert math.isnan(c.correlation) and np.isfinite(c.ppl_ref.value)
    r[11, 3] = -np.inf                      # the reference rules it out too: both NLLs inf, their ratio inf / inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = lmmetrics.compare(z, t, reference_logits=r)
    assert c.ppl.value == c.ppl_ref.value == math.inf
    assert math.isnan(c.ln_ratio.value) and math.isnan(c.ratio.value)   # (llama.cpp's inf - inf)


def test_percentiles_are_numpys_to_the_bit():
    """Finite per-token values: each percentile is numpy's linear quantile,
    bit for bit (Δp's values of either sign included)."""
    from lmmetrics.comparison import DELTA_P_PERCENTILES, _quantile

    rng = np.random.default_rng(9)
    for n in (1, 2, 3, 11, 100, 1001):
        for scale in (1e-3, 1.0, 1e3):
            x = np.sort(rng.standard_normal(n) * scale)
            for p in DELTA_P_PERCENTILES:
                assert _quantile(x, p / 100) == float(np.quantile(x, p / 100)), (n, scale, p)


def test_squares_past_float64_give_an_infinite_uncertainty():
    """A float64 model that masks entries with -1e300 where its reference
    does not: per-token KL (and, on a masked target, NLL) values of about
    1e300 are finite, but their squares pass float64's range. The spread of
    such values is not known from the sums: the uncertainty is inf, as
    `evaluate`'s standard error is (it was 0 for the mean KL, and 4.8e148
    for the ln(PPL ratio) of 5e299, from inf - inf taken as no spread), and
    no overflow warning."""
    import warnings

    rng = np.random.default_rng(3)
    n, v = 20, 8
    r = rng.standard_normal((n, v))
    z = r + 0.1 * rng.standard_normal((n, v))
    z[:5, 2] = -1e300                       # the model masks token 2 on 5 rows; the reference does not
    t = rng.integers(0, v, n)
    t[t == 2] = 3
    c = lmmetrics.compare(z, t, reference_logits=r)
    with np.errstate(over="ignore"):  # (the reference's variance of values of 1e300)
        kl = reference_stats(r, z, t)["kld_values"]
    assert np.isfinite(kl).all() and kl.max() > 1e299
    assert c.kld.mean.value == pytest.approx(kl.mean(), rel=1e-12)
    assert c.kld.mean.uncertainty == math.inf
    assert lmmetrics.evaluate(z, t, reference_logits=r).stderr["kl"] == math.inf
    assert math.isfinite(c.ppl.value) and math.isfinite(c.ppl.uncertainty)   # the targets keep their mass
    t[0] = 2                                # a target the model masks: its NLL is 1e300
    c = lmmetrics.compare(z, t, reference_logits=r)
    assert math.isfinite(c.ln_ratio.value) and c.ln_ratio.value > 1e298
    assert c.ln_ratio.uncertainty == math.inf
    assert c.ppl.value == c.ratio.value == c.delta_ppl.value == math.inf
    assert c.ppl.uncertainty == c.ratio.uncertainty == c.delta_ppl.uncertainty == math.inf
    assert math.isfinite(c.ppl_ref.uncertainty) and c.ppl_ref.uncertainty > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(lmmetrics.compare(z, t, reference_logits=r)) == str(c)



def test_means_whose_sum_passes_float64():
    """float64 logits masked with finfo(float64).min on a token the
    reference gives mass to: per-token KL (and, on masked targets, NLL) of
    about 2e307 are finite, and so are their means, though their sum passes
    float64's range: kl_divergence and compare's mean KL were inf (for
    1.92e307, with an overflow warning from kl_divergence), the ln(PPL
    ratio) inf for 2.7e307; reduction="sum" stays inf, past float64."""
    import warnings

    rng = np.random.default_rng(0)
    r = rng.standard_normal((20, 8))
    z = r + 0.1 * rng.standard_normal(r.shape)
    z[:, 2] = np.finfo(np.float64).min
    t = rng.integers(0, 8, 20)
    t[t == 2] = 3
    t[:3] = 2                               # three targets the model masks
    lr, lz = log_softmax(r), log_softmax(z)
    kl = (np.exp(lr) * (lr - lz)).sum(-1)
    rows = np.arange(20)
    d = lr[rows, t] - lz[rows, t]           # nll_m - nll_r
    assert np.isfinite(kl).all() and np.isfinite(d).all() and d.max() > 1e307
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lmmetrics.kl_divergence(z, reference_logits=r) == pytest.approx(np.mean(kl / 16) * 16, rel=1e-12)
        assert lmmetrics.kl_divergence(z, reference_logits=r, reduction="sum") == math.inf
        c = lmmetrics.compare(z, t, reference_logits=r)
    assert c.kld.mean.value == pytest.approx(np.mean(kl / 16) * 16, rel=1e-12)
    assert c.ln_ratio.value == pytest.approx(np.mean(d / 16) * 16, rel=1e-12)
    assert c.kld.mean.uncertainty == c.ln_ratio.uncertainty == math.inf
    assert c.ppl.value == math.inf


@pytest.mark.parametrize("n", [100, 257, 1000, 4096, 25500])
def test_llama_cpp_percentiles_against_its_c_code(llama_harness, n):
    """The extremes, percentiles and medians of llama_cpp() are llama.cpp's:
    its values stored as float, each percentile interpolated in float at
    fraction * (n - 1) with the fraction a float (0.999f, 1.3e-8 above
    0.999: on 1000 heavy-tailed KLs the 99.9% line read 0.179991 where
    llama.cpp prints 0.180051); the table keeps numpy's rule in float64."""
    rng = np.random.default_rng(n)
    lines = []
    for _ in range(3):
        kld = np.abs(rng.standard_t(2, n)) * 0.01
        m = rng.random(n) * 3
        r = np.abs(m + rng.standard_normal(n) * 0.3)
        same = rng.random(n) < 0.9
        c = lmmetrics.comparison.comparison_from_tokens(m, r, kld, same)
        want = [w for w in llama_harness(m, r, kld, same) if ("KLD:" in w or "Δp:" in w) and "Mean" not in w]
        assert len(want) == 24
        labels = {w.split(":")[0] for w in want}
        lines += [(got, w) for got, w in zip([x for x in c.llama_cpp().splitlines() if x.split(":")[0] in labels],
                                              want)]
        assert c.kld.percentiles[99.9] == float(np.quantile(kld, 99.9 / 100))
    assert all(got == w for got, w in lines), [(got, w) for got, w in lines if got != w]


def test_ratio_of_two_infinite_perplexities():
    """Both models mask the same targets with finfo(float64).min (their
    NLLs there about 1.8e308, both perplexities inf) and agree elsewhere but
    for noise: the PPL ratio is e^ln_ratio, the finite mean of the paired
    differences (llama.cpp's ppl / ppl_base was inf / inf, NaN), its
    uncertainty inf as the ln ratio's (their squares pass float64)."""
    rng = np.random.default_rng(3)
    r = rng.standard_normal((20, 8))
    z = r + 1e-3 * rng.standard_normal(r.shape)
    z[:, 2] = r[:, 2] = np.finfo(np.float64).min / 2
    t = rng.integers(0, 8, 20)
    t[:4] = 2
    rows = np.arange(20)
    d = log_softmax(r)[rows, t] - log_softmax(z)[rows, t]   # nll_m - nll_r: finite and small
    assert np.isfinite(d).all() and abs(d).max() < 1e-2
    c = lmmetrics.compare(z, t, reference_logits=r)
    assert c.ppl.value == c.ppl_ref.value == math.inf
    assert c.ln_ratio.value == pytest.approx(d.mean(), rel=1e-6, abs=1e-12)
    assert c.ratio.value == pytest.approx(math.exp(d.mean()), rel=1e-9)
    assert c.ratio.uncertainty == c.ln_ratio.uncertainty == math.inf


def test_sequences_of_one_position_under_shift_say_so():
    """shift=True on sequences of one position leaves nothing to score: the
    error names the shift, not only ignored targets."""
    z = np.zeros((3, 1, 5), np.float32)
    t = np.zeros((3, 1), np.int64)
    with pytest.raises(ValueError, match=r"no counted token to compare .*shift=True scores no sequence's last"):
        lmmetrics.compare(z, t, reference_logits=z, shift=True)
