"""A model against its reference: the statistics llama.cpp's perplexity
tool prints for a quantized model against its base model (``--kl-divergence``),
computed exactly from both logits in one read (float64 sums, no 16-bit
storage of the reference, no cutoff).

Per counted token t: nll_m and nll_r (the model's and the reference's NLL of
the target), kld_t = KL(P_ref || P_model), same_t (argmax agreement) and
dp_t = exp(-nll_m) - exp(-nll_r). A mean f = s / n of n values with sums s,
s2 has the uncertainty sqrt((s2 / n - f^2) / (n - 1)) when that is positive
and n > 10, else 0; the covariance of the two NLLs is 0 below 10 tokens
(llama.cpp's rules: no uncertainty on so few tokens).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _engine
from ._types import BoolArray, F64Array
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
        One standard error; 0 where too few tokens were counted to give one.
    """

    value: float
    uncertainty: float

    def __str__(self) -> str:
        return f"{self.value:.6f} ± {self.uncertainty:.6f}"


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
    """What :func:`compare` returns; ``str()`` prints llama.cpp's tables.

    Attributes
    ----------
    tokens : int
        Counted tokens.
    ppl, ppl_ref : Estimate
        ``exp(mean NLL)`` of the model and of the reference.
    correlation : float
        Of the per-token NLL of model and reference.
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

    def as_dict(self) -> Dict[str, Any]:
        """Nested plain dicts (JSON-ready; percentile keys as strings).

        Returns
        -------
        dict
        """
        d = asdict(self)
        for k in ("kld", "delta_p"):
            d[k]["percentiles"] = {_pct_name(p): v for p, v in d[k]["percentiles"].items()}
        return d

    def __str__(self) -> str:
        """llama.cpp's tables with units (nats, %) and the token count."""
        extra = []
        if self.top_k_agreement is not None:
            e = self.top_k_agreement
            extra = [f"Base top in top {self.top_k}: {100 * e.value:6.3f} ± {100 * e.uncertainty:5.3f} %"]
        return "\n".join([f"{text} {unit}" if unit else text for text, unit in self._lines()] + extra +
                         [f"Tokens    : {self.tokens}"])

    def llama_cpp(self) -> str:
        """The statistics exactly as ``llama-perplexity --kl-divergence``
        prints them (its printf formats, no units, no token count)."""
        return "\n".join(text for text, _ in self._lines())

    def _lines(self) -> List[Tuple[str, str]]:
        """(llama.cpp's line, its unit) for each line of the tables."""
        def est(e: Estimate) -> str:
            return f"{e.value:10.6f} ± {e.uncertainty:10.6f}"

        def pct(e: Estimate) -> str:
            return f"{100 * e.value:6.3f} ± {100 * e.uncertainty:5.3f} %"

        def label(p: float) -> str:
            return "Median " if p == 50.0 else f"{p:4.1f}%  "

        nats = "nats"
        return [("====== Perplexity statistics ======", ""),
                (f"Mean PPL(Q)                   : {est(self.ppl)}", ""),
                (f"Mean PPL(base)                : {est(self.ppl_ref)}", ""),
                (f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * self.correlation:6.2f}%", ""),
                (f"Mean ln(PPL(Q)/PPL(base))     : {est(self.ln_ratio)}", nats),
                (f"Mean PPL(Q)/PPL(base)         : {est(self.ratio)}", ""),
                (f"Mean PPL(Q)-PPL(base)         : {est(self.delta_ppl)}", ""),
                ("", ""),
                ("====== KL divergence statistics ======", ""),
                (f"Mean    KLD: {est(self.kld.mean)}", nats),
                (f"Maximum KLD: {self.kld.max:10.6f}", nats)] + \
            [(f"{label(p)} KLD: {v:10.6f}", nats) for p, v in self.kld.ordered()] + \
            [(f"Minimum KLD: {self.kld.min:10.6f}", nats),
             ("", ""),
             ("====== Token probability statistics ======", ""),
             (f"Mean    Δp: {pct(self.delta_p.mean)}", ""),
             (f"Maximum Δp: {100 * self.delta_p.max:6.3f}%", "")] + \
            [(f"{label(p)} Δp: {100 * v:6.3f}%", "") for p, v in self.delta_p.ordered()] + \
            [(f"Minimum Δp: {100 * self.delta_p.min:6.3f}%", ""),
             (f"RMS Δp    : {pct(self.rms_delta_p)}", ""),
             (f"Same top p: {pct(self.same_top)}", "")]


def _pct_name(p: float) -> str:
    return "Median" if p == 50.0 else f"{p:g}%"


def _mean_sigma(s: float, s2: float, n: int) -> Tuple[float, float]:
    """mean and its uncertainty from the sum and the sum of squares"""
    f = s / n
    var = (s2 / n - f * f) / (n - 1) if n > 1 else 0.0
    return f, math.sqrt(var) if var > 0 and n > 10 else 0.0


def _distribution(x: F64Array, pcts: Sequence[float]) -> Distribution:
    n = x.size
    mean, sigma = _mean_sigma(float(np.sum(x)), float(np.sum(x * x)), n)
    per = {p: float(v) for p, v in zip(pcts, np.quantile(x, [p / 100.0 for p in pcts]))}
    median = per.pop(50.0)
    return Distribution(Estimate(mean, sigma), float(x.max()), float(x.min()), median, per)


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
        raise ValueError("no counted token to compare (every target is ignored)")
    mean_m, sig_m = _mean_sigma(float(np.sum(nll_m)), float(np.sum(nll_m * nll_m)), n)
    mean_r, sig_r = _mean_sigma(float(np.sum(nll_r)), float(np.sum(nll_r * nll_r)), n)
    cov = (float(np.sum(nll_m * nll_r)) / n - mean_m * mean_r) / (n - 1) if n >= 10 else 0.0
    ppl, ppl_r = exp(mean_m), exp(mean_r)
    u_m, u_r = ppl * sig_m, ppl_r * sig_r
    corr = cov / (sig_m * sig_r) if sig_m > 0 and sig_r > 0 else math.nan
    ln_ratio = mean_m - mean_r
    ln_unc = math.sqrt(max(sig_m ** 2 + sig_r ** 2 - 2 * cov, 0.0))
    ratio = exp(ln_ratio)
    d_unc = math.sqrt(max(u_m ** 2 + u_r ** 2 - 2 * ppl * ppl_r * cov, 0.0))
    dp = np.exp(-nll_m) - np.exp(-nll_r)
    dp2 = dp * dp
    ms, ms_sig = _mean_sigma(float(np.sum(dp2)), float(np.sum(dp2 * dp2)), n)
    rms = math.sqrt(ms)
    k = int(np.count_nonzero(same))
    p_same = k / n
    agreement = None
    if in_top_k is not None:
        p_in = int(np.count_nonzero(in_top_k)) / n
        agreement = Estimate(p_in, math.sqrt(p_in * (1 - p_in) / (n - 1)) if n > 1 else 0.0)
    return Comparison(
        tokens=n,
        ppl=Estimate(ppl, u_m), ppl_ref=Estimate(ppl_r, u_r), correlation=corr,
        ln_ratio=Estimate(ln_ratio, ln_unc), ratio=Estimate(ratio, ratio * ln_unc),
        delta_ppl=Estimate(ppl - ppl_r, d_unc),
        kld=_distribution(kld, KLD_PERCENTILES),
        delta_p=_distribution(dp, DELTA_P_PERCENTILES),
        rms_delta_p=Estimate(rms, 0.5 / rms * ms_sig if rms > 0 else 0.0),
        same_top=Estimate(p_same, math.sqrt(p_same * (1 - p_same) / (n - 1)) if n > 1 else 0.0),
        top_k=top_k if in_top_k is not None else None, top_k_agreement=agreement)


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
        or :func:`lmmetrics.model_logits`, which come with unshifted ids.
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
    :func:`comparison_from_tokens` takes (concatenate those of several chunks
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
