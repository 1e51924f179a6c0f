"""A model against its reference: the statistics llama.cpp's perplexity
tool prints for a quantized model against its base model (``--kl-divergence``),
computed exactly from both logits in one read (float64 sums, no 16-bit
storage of the reference, no cutoff).

Per counted token t: nll_m and nll_r (the model's and the reference's NLL of
the target), kld_t = KL(P_ref || P_model), same_t (argmax agreement) and
dp_t = exp(-nll_m) - exp(-nll_r). A mean f = s / n of n values with sums s,
s2 has the uncertainty sqrt((s2 / n - f^2) / (n - 1)) when that is positive
and n > 10, else 0; the covariance of the two NLLs is 0 below 10 tokens
(llama.cpp's rules: no uncertainty on so few tokens). The uncertainties
derived from that covariance (ln(PPL ratio), ratio, PPL difference) are 0 on
10 tokens or fewer too; above, they are taken from the paired per-token
differences themselves (nll_m - nll_r, ppl nll_m - ppl_ref nll_r, two passes),
which is llama.cpp's sqrt(s_m^2 + s_r^2 - 2 cov) without its cancellation:
of two models whose logits agree to 1e-8, that difference of near-equal
terms gave 15 times the spread, and a negative variance (no uncertainty)
where the spread is small but not 0.

``Comparison.llama_cpp()`` replays llama.cpp's arithmetic on the same sums,
step for step (its ``kl_divergence`` in tools/perplexity/perplexity.cpp), so
that it prints what llama.cpp prints where that is not a number: the square
root of a negative variance, ``0.5 / 0`` times 0 for the RMS Δp of identical
models, a correlation of 0 / 0 or c / 0 (fewer than 11 tokens), as glibc's
printf writes them (``-nan`` for the processor's default NaN on x86-64,
``inf``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _engine
from ._engine.types import BoolArray, F64Array
from ._spread import finite_mean, sample_stderr
from .convert import exp

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


@dataclass(frozen=True)
class Estimate:
    """A value with its uncertainty (one standard error).

    Attributes
    ----------
    value : float
    uncertainty : float
        One standard error; 0 where too few tokens were counted to give one,
        inf where the value is infinite or its values' squares sum past
        float64's range (values past 1.3e154: no spread to tell).
    """

    value: float
    uncertainty: float

    def __str__(self) -> str:
        """Six significant digits and two of the uncertainty, as `Metrics`
        prints them (a mean KL of 3.2e-7 is not 0.000000)."""
        return f"{self.value:.6g} ± {self.uncertainty:.2g}"


@dataclass(frozen=True)
class Distribution:
    """Mean (with uncertainty), extremes and percentiles of per-token values.

    Percentiles interpolate linearly at ``f (n - 1)`` on the sorted values.

    Attributes
    ----------
    mean : Estimate
    max, min, median : float
    percentiles : dict of float to float
        Percent (e.g. 99.9) to value.
    """

    mean: Estimate
    max: float
    min: float
    median: float
    percentiles: Dict[float, float] = field(default_factory=dict)

    def ordered(self) -> List[Tuple[float, float]]:
        """The percentiles, the median among them, from the highest down.

        Returns
        -------
        list of (float, float)
            ``(percent, value)`` pairs.
        """
        items = {**self.percentiles, 50.0: self.median}
        return sorted(items.items(), reverse=True)


@dataclass(frozen=True)
class Comparison:
    """What `compare` returns; ``str()`` prints llama.cpp's tables.

    Attributes
    ----------
    tokens : int
        Counted tokens.
    ppl, ppl_ref : Estimate
        ``exp(mean NLL)`` of the model and of the reference.
    correlation : float
        Of the per-token NLL of model and reference; NaN on 10 tokens or
        fewer (no uncertainties to divide by) and where an NLL is infinite.
    ln_ratio : Estimate
        Mean ``ln(PPL / PPL_ref)``.
    ratio : Estimate
        ``PPL / PPL_ref``.
    delta_ppl : Estimate
        ``PPL - PPL_ref``.
    kld : Distribution
        ``KL(P_ref || P_model)`` per token, nats.
    delta_p : Distribution
        ``p_model(target) - p_ref(target)`` per token.
    rms_delta_p : Estimate
        ``sqrt(mean dp^2)``.
    same_top : Estimate
        Fraction of tokens whose argmaxes agree.
    top_k : int or None
        The k of ``top_k_agreement`` (``compare(..., top_k=k)``).
    top_k_agreement : Estimate or None
        Fraction of tokens whose reference top-1 token is among the model's
        top k (its rank in the model's logits, the number of logits above
        it plus those equal to it at a lower index, is below k).
    """

    tokens: int
    ppl: Estimate             #: exp(mean nll) of the model
    ppl_ref: Estimate         #: exp(mean nll) of the reference
    correlation: float        #: of the per-token nll of model and reference
    ln_ratio: Estimate        #: mean ln(PPL / PPL_ref)
    ratio: Estimate           #: PPL / PPL_ref
    delta_ppl: Estimate       #: PPL - PPL_ref
    kld: Distribution         #: KL(P_ref || P_model) per token, nats
    delta_p: Distribution     #: p_model(target) - p_ref(target) per token
    rms_delta_p: Estimate     #: sqrt(mean dp^2)
    same_top: Estimate        #: fraction of tokens whose argmaxes agree
    top_k: Optional[int] = None  #: the k of top_k_agreement
    top_k_agreement: Optional[Estimate] = None  #: share whose reference top-1 is in the model's top k
    #: the values of llama.cpp's lines by its own arithmetic (NaN / inf where it has them), for llama_cpp()
    _llama: Optional["_Printed"] = field(default=None, repr=False, compare=False)

    def as_dict(self) -> Dict[str, Any]:
        """Nested plain dicts (JSON-ready; percentile keys as strings).

        Returns
        -------
        dict
        """
        d = asdict(self)
        del d["_llama"]
        for k in ("kld", "delta_p"):
            d[k]["percentiles"] = {_pct_name(p): v for p, v in d[k]["percentiles"].items()}
        return d

    def __str__(self) -> str:
        """llama.cpp's tables with units (nats, %) and the token count."""
        extra = []
        if self.top_k_agreement is not None:
            e = self.top_k_agreement
            extra = [f"Base top in top {self.top_k}: {100 * e.value:6.3f} ± {100 * e.uncertainty:5.3f} %"]
        return "\n".join([f"{text} {unit}" if unit else text for text, unit in self._lines(self._printed())] +
                         extra + [f"Tokens    : {self.tokens}"])

    def llama_cpp(self) -> str:
        """The statistics exactly as ``llama-perplexity --kl-divergence``
        prints them (its printf formats and its arithmetic, ``-nan`` and
        ``inf`` included; no units, no token count)."""
        v = self._llama if self._llama is not None else self._printed()
        return "\n".join(text for text, _ in self._lines(v))

    def _printed(self) -> "_Printed":
        """The values of the table's lines, from the fields."""
        return _Printed(self.ppl.value, self.ppl.uncertainty, self.ppl_ref.value, self.ppl_ref.uncertainty,
                        self.correlation, self.ln_ratio.value, self.ln_ratio.uncertainty, self.ratio.value,
                        self.ratio.uncertainty, self.delta_ppl.value, self.delta_ppl.uncertainty,
                        self.kld.mean.value, self.kld.mean.uncertainty, self.delta_p.mean.value,
                        self.delta_p.mean.uncertainty, self.rms_delta_p.value, self.rms_delta_p.uncertainty,
                        self.same_top.value, self.same_top.uncertainty, self.kld, self.delta_p)

    def _lines(self, v: "_Printed") -> List[Tuple[str, str]]:
        """(llama.cpp's line, its unit) for each line of the tables, with
        the values ``v`` of the lines its formulas give."""
        def est(x: float, u: float) -> str:
            return f"{_c(x, '10.6f')} ± {_c(u, '10.6f')}"

        def pct(x: float, u: float) -> str:
            return f"{_c(100.0 * x, '6.3f')} ± {_c(100.0 * u, '5.3f')} %"

        def label(p: float) -> str:
            return "Median " if p == 50.0 else f"{p:4.1f}%  "

        nats = "nats"
        return [("====== Perplexity statistics ======", ""),
                (f"Mean PPL(Q)                   : {est(v.ppl, v.ppl_unc)}", ""),
                (f"Mean PPL(base)                : {est(v.ppl_base, v.ppl_base_unc)}", ""),
                (f"Cor(ln(PPL(Q)), ln(PPL(base))): {_c(100.0 * v.cor, '6.2f')}%", ""),
                (f"Mean ln(PPL(Q)/PPL(base))     : {est(v.ln_ratio, v.ln_ratio_unc)}", nats),
                (f"Mean PPL(Q)/PPL(base)         : {est(v.ratio, v.ratio_unc)}", ""),
                (f"Mean PPL(Q)-PPL(base)         : {est(v.diff, v.diff_unc)}", ""),
                ("", ""),
                ("====== KL divergence statistics ======", ""),
                (f"Mean    KLD: {est(v.kld, v.kld_unc)}", nats),
                (f"Maximum KLD: {_c(v.kld_values.max, '10.6f')}", nats)] + \
            [(f"{label(p)} KLD: {_c(x, '10.6f')}", nats) for p, x in v.kld_values.ordered()] + \
            [(f"Minimum KLD: {_c(v.kld_values.min, '10.6f')}", nats),
             ("", ""),
             ("====== Token probability statistics ======", ""),
             (f"Mean    Δp: {pct(v.dp, v.dp_unc)}", ""),
             (f"Maximum Δp: {_c(100 * v.dp_values.max, '6.3f')}%", "")] + \
            [(f"{label(p)} Δp: {_c(100 * x, '6.3f')}%", "") for p, x in v.dp_values.ordered()] + \
            [(f"Minimum Δp: {_c(100 * v.dp_values.min, '6.3f')}%", ""),
             (f"RMS Δp    : {pct(v.rms, v.rms_unc)}", ""),
             (f"Same top p: {pct(v.same, v.same_unc)}", "")]


def _pct_name(p: float) -> str:
    return "Median" if p == 50.0 else f"{p:g}%"


# ---------------------------------------------------------------------------
# llama.cpp's arithmetic (kl_divergence in tools/perplexity/perplexity.cpp),
# in IEEE double as C computes it (no contraction into fused multiply-adds):
# where C's operations give NaN or inf (0 / 0, c / 0, the square root of a
# negative number) these do too, instead of raising as Python does.

_INF = float("inf")
_NAN = _INF - _INF  # the processor's default NaN, as C's invalid operations give it (negative on x86-64)


def _div(a: float, b: float) -> float:
    """C's ``a / b``."""
    if b != 0.0 or math.isnan(b):
        return a / b
    if math.isnan(a):
        return a
    return _NAN if a == 0.0 else math.copysign(_INF, a) * math.copysign(1.0, b)


def _sqrt(x: float) -> float:
    """C's ``sqrt(x)``."""
    if math.isnan(x):
        return x
    return _NAN if x < 0.0 else math.sqrt(x)


def _c(x: float, spec: str) -> str:
    """printf's ``%<spec>`` of a double, as glibc writes it: a NaN is
    ``-nan`` or ``nan`` by its sign bit, an infinity ``inf`` / ``-inf``,
    right-aligned in the width."""
    if math.isfinite(x):
        return format(x, spec)
    text = ("-" if math.copysign(1.0, x) < 0 else "") + ("nan" if math.isnan(x) else "inf")
    return text.rjust(int(spec.split(".")[0]))


def _mean_sigma(s: float, s2: float, n: int) -> Tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: the mean of n values from their
    sum and sum of squares, and its uncertainty (0 on 10 values or fewer)."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def _covariance(sa: float, sb: float, sab: float, n: int) -> float:
    """llama.cpp's covariance of the means (0 below 10 values)."""
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


class _Printed(NamedTuple):
    """The values of the lines that llama.cpp computes from its sums."""

    ppl: float
    ppl_unc: float
    ppl_base: float
    ppl_base_unc: float
    cor: float
    ln_ratio: float
    ln_ratio_unc: float
    ratio: float
    ratio_unc: float
    diff: float
    diff_unc: float
    kld: float
    kld_unc: float
    dp: float
    dp_unc: float
    rms: float
    rms_unc: float
    same: float
    same_unc: float
    kld_values: Distribution  # (its max, min, median and percentiles)
    dp_values: Distribution


def _llama_cpp_arithmetic(n: int, nll: Tuple[float, float], nll_base: Tuple[float, float], nll_nll_base: float,
                          kld: Tuple[float, float], p_diff: Tuple[float, float, float], n_same: int,
                          kld_values: F64Array, p_diff_values: F64Array) -> _Printed:
    """llama.cpp's statistics from its sums over n tokens, step for step:
    (sum, sum of squares) of the NLLs and KLs, the sum of their products,
    (sum, of squares, of fourth powers) of Δp, and the same-top count; and
    the per-token KL and Δp for their extremes and percentiles."""
    log_ppl, log_ppl_unc = _mean_sigma(*nll, n)
    ppl = exp(log_ppl)
    ppl_unc = ppl * log_ppl_unc
    log_base, log_base_unc = _mean_sigma(*nll_base, n)
    ppl_base = exp(log_base)
    ppl_base_unc = ppl_base * log_base_unc
    cov = _covariance(nll[0], nll_base[0], nll_nll_base, n)
    ln_ratio = log_ppl - log_base
    ln_ratio_unc = _sqrt(log_ppl_unc * log_ppl_unc + log_base_unc * log_base_unc - 2.0 * cov)
    ratio = exp(ln_ratio)
    diff_unc = _sqrt(ppl_unc * ppl_unc + ppl_base_unc * ppl_base_unc - 2.0 * (ppl * ppl_base * cov))
    mse, mse_unc = _mean_sigma(p_diff[1], p_diff[2], n)
    rms = _sqrt(mse)
    same = 1.0 * n_same / n
    return _Printed(ppl, ppl_unc, ppl_base, ppl_base_unc, _div(cov, log_ppl_unc * log_base_unc),
                    ln_ratio, ln_ratio_unc, ratio, ratio * ln_ratio_unc, ppl - ppl_base, diff_unc,
                    *_mean_sigma(*kld, n), *_mean_sigma(p_diff[0], p_diff[1], n),
                    rms, _div(0.5, rms) * mse_unc, same, _sqrt(_div(same * (1.0 - same), n - 1)),
                    _llama_cpp_distribution(kld_values, KLD_PERCENTILES),
                    _llama_cpp_distribution(p_diff_values, DELTA_P_PERCENTILES))


def _llama_cpp_distribution(x: F64Array, pcts: Sequence[float]) -> Distribution:
    """The extremes and percentiles llama.cpp prints of per-token values
    (mean left 0): stored as float (its ``kld_values``, ``p_diff_values``)
    and sorted; a percentile interpolated in float at ``fraction * (n - 1)``,
    the fraction itself a float (``0.999f``, 1.3e-8 above 0.999: the 99.9%
    line of 1000 tokens moves by 1.3e-5 of the gap it interpolates); the
    median the float mean of the middle two."""
    f32 = np.float32
    with np.errstate(over="ignore", invalid="ignore"):  # (float's inf and NaN, as C's)
        s = np.sort(x.astype(f32))
        n = s.size

        def percentile(p: float) -> float:
            pos = f32(p / 100.0) * f32(n - 1)
            ip = int(pos)
            t = pos - f32(ip)
            return float((f32(1.0) - t) * s[ip] + t * s[min(ip + 1, n - 1)])

        median = float(f32(0.5) * (s[n // 2] + s[n // 2 - 1]) if n % 2 == 0 else s[n // 2])
        per = {p: percentile(p) for p in pcts if p != 50.0}
    return Distribution(Estimate(0.0, 0.0), float(s[-1]), float(s[0]), median, per)


def _quantile(s: F64Array, f: float) -> float:
    """The f-quantile of the sorted values s, interpolated linearly at
    f (n - 1) (numpy's and llama.cpp's rule) between a = s[lo] and b, from
    the nearer end as numpy does (the same bits); next to an infinite value,
    that value for t > 0 and a at t = 0 (numpy's interpolation gives NaN
    there: inf - inf)."""
    pos = f * (s.size - 1)
    lo = int(pos)
    t = pos - lo
    a, b = float(s[lo]), float(s[min(lo + 1, s.size - 1)])
    if t == 0.0 or a == b:
        return a
    if math.isinf(b) or math.isinf(a):
        return b if math.isinf(b) else a
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1.0 - t)


def _distribution(x: F64Array, pcts: Sequence[float], mean: Estimate) -> Distribution:
    s = np.sort(x)
    per = {p: _quantile(s, p / 100.0) for p in pcts}
    median = per.pop(50.0)
    return Distribution(mean, float(s[-1]), float(s[0]), median, per)


def _estimate(value: float, uncertainty: float) -> Estimate:
    """An Estimate; an infinite value (a token the model rules out) has an
    infinite uncertainty, as `lmmetrics.evaluate`'s standard errors do,
    where llama.cpp's arithmetic gives 0 or NaN."""
    return Estimate(value, uncertainty if math.isfinite(value) else math.inf)


def _spread(uncertainty: float, sums: Tuple[float, float]) -> float:
    """A mean's uncertainty from its (sum, sum of squares): inf where the sum
    of squares passed float64's range (llama.cpp's arithmetic gives 0 there)."""
    return uncertainty if math.isfinite(sums[1]) else math.inf


def comparison_from_tokens(nll_m: F64Array, nll_r: F64Array, kld: F64Array,
                           same: BoolArray, in_top_k: Optional[BoolArray] = None,
                           top_k: Optional[int] = None) -> Comparison:
    """The statistics from per-token float64 values of the counted tokens.

    Parameters
    ----------
    nll_m, nll_r, kld : numpy.ndarray
        Per-token NLL of the model and of the reference, and the KL, float64.
    same : numpy.ndarray
        Per token, whether the argmaxes agree (bool).
    in_top_k : numpy.ndarray or None
        Per token, whether the reference's top-1 is in the model's top
        ``top_k`` (bool).
    top_k : int or None
        Its k.

    Returns
    -------
    Comparison
    """
    n = int(nll_m.size)
    if n == 0:
        raise ValueError("no counted token to compare (every target is ignored, or no position is left: "
                         "shift=True scores no sequence's last position)")

    def sums(x: F64Array) -> Tuple[float, float]:
        return float(np.sum(x)), float(np.sum(x * x))

    with np.errstate(over="ignore"):  # squares past float64's range (values past 1.3e154) are inf
        dp = np.exp(-nll_m) - np.exp(-nll_r)
        dp2 = dp * dp
        s_m, s_r, s_k = sums(nll_m), sums(nll_r), sums(kld)
        s_mr = float(np.sum(nll_m * nll_r))
    v = _llama_cpp_arithmetic(n, s_m, s_r, s_mr, s_k, (float(np.sum(dp)), *sums(dp2)),
                              int(np.count_nonzero(same)), kld, dp)
    # the uncertainties where llama.cpp's arithmetic gives none (NaN, inf): 0 on 10 tokens or fewer, for
    # the RMS Δp of identical models and the same top of 1 token; inf where a sum of squares or products
    # is (finite values past 1.3e154, a model's finite mask of -1e300 on a token the reference gives mass
    # to): llama.cpp's 0 or a number there, a spread unknown. Those of the paired differences (ln ratio,
    # PPL difference) from the differences themselves: llama.cpp's s_m^2 + s_r^2 - 2 cov is their
    # variance, but as a difference of near-equal terms where the models agree (15 times the spread at
    # logits 1e-8 apart), or a negative one (no uncertainty) where the spread is small
    many = n > 10
    wide_nll = not (math.isfinite(s_m[1]) and math.isfinite(s_r[1]) and math.isfinite(s_mr))
    ln_unc = diff_unc = 0.0
    if wide_nll:
        ln_unc = diff_unc = math.inf
    elif many:
        ln_unc = sample_stderr(nll_m - nll_r)
        top = max(v.ppl, v.ppl_base)  # (the differences scaled by it, so that ppl nll_m stays finite)
        diff_unc = (top * sample_stderr(v.ppl / top * nll_m - v.ppl_base / top * nll_r)
                    if math.isfinite(top) else math.inf)
    # (llama.cpp's means, or where their sums passed float64's range, the values' finite means; a token
    # both models rule out is inf - inf, NaN, as llama.cpp's mean)
    with np.errstate(invalid="ignore"):
        ln_ratio = finite_mean(v.ln_ratio, nll_m - nll_r)
    # (both perplexities inf, their means past 709 nats: llama.cpp's inf / inf is NaN, the ratio e^ln_ratio)
    ratio = exp(ln_ratio) if math.isnan(v.ratio) and math.isfinite(ln_ratio) else v.ratio
    agreement = None
    if in_top_k is not None:
        p_in = int(np.count_nonzero(in_top_k)) / n
        agreement = Estimate(p_in, math.sqrt(p_in * (1 - p_in) / (n - 1)) if n > 1 else 0.0)
    return Comparison(
        tokens=n,
        ppl=_estimate(v.ppl, _spread(v.ppl_unc, s_m)), ppl_ref=_estimate(v.ppl_base, _spread(v.ppl_base_unc, s_r)),
        correlation=v.cor if math.isfinite(v.cor) else math.nan,
        ln_ratio=_estimate(ln_ratio, ln_unc),
        ratio=_estimate(ratio, ratio * ln_unc if ratio > 0 else 0.0),
        delta_ppl=_estimate(v.diff, diff_unc),
        kld=_distribution(kld, KLD_PERCENTILES, _estimate(finite_mean(v.kld, kld), _spread(v.kld_unc, s_k))),
        delta_p=_distribution(dp, DELTA_P_PERCENTILES, Estimate(v.dp, v.dp_unc)),
        rms_delta_p=Estimate(v.rms, v.rms_unc if v.rms > 0 else 0.0),
        same_top=Estimate(v.same, v.same_unc if n > 1 else 0.0),
        top_k=top_k if in_top_k is not None else None, top_k_agreement=agreement, _llama=v)


def compare(logits: Any, targets: Any, *, reference_logits: Any, ignore_index: Optional[int] = -100,
            shift: Optional[bool] = None, softcap: Optional[float] = None,
            num_threads: Optional[int] = None, top_k: Optional[int] = None) -> Comparison:
    """Compare a model's logits with a reference model's on the same tokens.

    The statistics llama.cpp's ``perplexity --kl-divergence`` prints, from one
    read of both buffers together (float64 sums, no 16-bit storage of the
    reference).

    Parameters
    ----------
    logits : array_like, torch.Tensor or model output
        Logits shaped (..., V), the vocabulary last: a numpy array or a torch
        tensor (CPU, read in place; CUDA, computed on its device) in float32,
        float64, float16 or bfloat16, or an object with ``.logits`` (a
        Hugging Face model output).
    targets : array_like or torch.Tensor
        Integer token ids shaped like the logits without their last axis
        (unshifted labels, one per logits position, with ``shift=True``).
    reference_logits : array_like, torch.Tensor or model output
        The reference model's logits (keyword-only, so that two buffers of the
        same shape cannot be swapped): the distribution P_ref the expectation
        is taken over. Same shape as ``logits``; the dtype may differ (a
        float32 base against bfloat16 or float16 logits), each read in its
        own dtype.
    ignore_index : int or None, default -100
        Targets equal to it are not counted, nor is any negative target
        (torch's -100, nanochat's -1); ``None`` ignores negative targets
        only. Ignored positions are not read.
    shift : bool or None, default None
        ``True`` for unshifted labels as Hugging Face passes them: position t
        of the logits is scored against ``targets[..., t + 1]`` and each
        sequence's last position is dropped (a view, no copy). ``False``:
        the targets are aligned with the logits. None (not said) is False
        for arrays and tensors, and an error for a model output (``.logits``)
        or `lmmetrics.model_logits`, which come with unshifted ids.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.
    top_k : int or None, default None
        Also ``top_k_agreement``: the share of tokens whose reference top-1
        token is among the model's top k (in [1, V]); reads the model's
        logits a second time.

    Returns
    -------
    Comparison
        ``print()`` it for llama.cpp's tables; ``as_dict()`` for JSON.

    Raises
    ------
    ValueError
        A counted target >= V, targets whose shape does not match the logits',
        NaN in the logits of a counted position, a counted row that is all
        -inf, or an option out of range.
    TypeError
        Integer logits or float targets.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> rng = np.random.default_rng(0)
    >>> base = rng.standard_normal((64, 100), dtype=np.float32) * 3
    >>> quant = base + rng.standard_normal(base.shape, dtype=np.float32) * 0.1
    >>> c = lmmetrics.compare(quant, rng.integers(0, 100, 64), reference_logits=base)
    >>> c.tokens, c.kld.mean.value < 0.01, c.same_top.value > 0.9
    (64, True, True)
    """
    return comparison_from_tokens(*token_values(reference_logits, logits, targets, ignore_index=ignore_index,
                                                shift=shift, softcap=softcap, num_threads=num_threads,
                                                top_k=top_k), top_k=top_k)


def token_values(reference_logits: Any, logits: Any, targets: Any, *, ignore_index: Optional[int] = -100,
                 shift: Optional[bool] = None, softcap: Optional[float] = None,
                 num_threads: Optional[int] = None, top_k: Optional[int] = None
                 ) -> Tuple[F64Array, F64Array, F64Array, BoolArray, Optional[BoolArray]]:
    """Per counted token, from one read of both logits, the values
    `comparison_from_tokens` takes (concatenate those of several chunks
    first). With ``top_k``, the model's logits are read a second time for
    the rank of the reference's top-1 token among them.

    Returns
    -------
    tuple of numpy.ndarray
        ``(nll_m, nll_r, kld, same, in_top_k)`` (``in_top_k`` None without
        ``top_k``).
    """
    k = None if top_k is None else _engine.check_positive_int("top_k", top_k)
    res = _engine.run(logits, targets, reference_logits, ignore_index=ignore_index, shift=shift,
                      softcap=softcap, num_threads=num_threads, nll=True, ref_nll=True, kl=True,
                      argmax=True)
    c = res.counted
    in_top_k = None
    if k is not None:
        if k > res.n_cols:
            raise ValueError(f"top_k {k} is above the vocabulary size {res.n_cols}")
        top = np.where(c, res.indices("ref_argmax"), -1).reshape(res.lead_shape)
        if shift:  # the same rows again: targets laid out unshifted, the first position ignored
            top = np.concatenate([np.full(top.shape[:-1] + (1,), -1, np.int64), top], axis=-1)
        ranks = _engine.run(logits, top, ignore_index=-1, shift=shift, softcap=softcap,
                            num_threads=num_threads, rank=True).indices("rank")
        in_top_k = ranks[c] < k
    return (res.floats("nll")[c], res.floats("ref_nll")[c], res.floats("kl")[c],
            res.indices("argmax")[c] == res.indices("ref_argmax")[c], in_top_k)
