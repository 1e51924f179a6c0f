"""Conversions between the units evaluations report, and corpus aggregation."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Union, overload

import numpy as np
import numpy.typing as npt

from ._engine.checks import check_positive_int
from ._engine.inputs import check_unmasked
from ._engine.types import F64Array, FloatArray

LN2 = math.log(2.0)


def exp(x: float) -> float:
    """e^x as a float, inf where it overflows (``math.exp`` raises there).

    A perplexity of a mean NLL above ~709.78 nats is inf, not an error.

    Parameters
    ----------
    x : float

    Returns
    -------
    float

    Examples
    --------
    >>> from lmmetrics import convert
    >>> convert.exp(0.0), convert.exp(1000.0)
    (1.0, inf)
    """
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def bits_per_unit(nll_sum: float, units: float) -> float:
    """Bits per unit (byte, character): ``nll_sum / (ln 2 * units)``.

    Parameters
    ----------
    nll_sum : float
        Summed NLL, nats.
    units : float
        Units scored.

    Returns
    -------
    float
        inf when no unit was counted.

    Examples
    --------
    >>> from lmmetrics import convert
    >>> round(convert.bits_per_unit(6.931471805599453, 5), 6)
    2.0
    """
    return nll_sum / (LN2 * units) if units else math.inf


__all__ = ["nats_to_bits", "bits_to_nats", "bpc_from_perplexity", "perplexity_from_bpc", "corpus_metrics"]


@overload
def nats_to_bits(x: float) -> float: ...
@overload
def nats_to_bits(x: npt.NDArray[Any]) -> FloatArray: ...


def nats_to_bits(x: Union[float, npt.NDArray[Any]]) -> Union[float, FloatArray]:
    """Nats to bits (divide by ln 2).

    Parameters
    ----------
    x : float or numpy.ndarray

    Returns
    -------
    float or numpy.ndarray

    Examples
    --------
    >>> from lmmetrics import convert
    >>> round(convert.nats_to_bits(0.6931471805599453), 6)
    1.0
    """
    return x / LN2


@overload
def bits_to_nats(x: float) -> float: ...
@overload
def bits_to_nats(x: npt.NDArray[Any]) -> FloatArray: ...


def bits_to_nats(x: Union[float, npt.NDArray[Any]]) -> Union[float, FloatArray]:
    """Bits to nats (multiply by ln 2).

    Parameters
    ----------
    x : float or numpy.ndarray

    Returns
    -------
    float or numpy.ndarray

    Examples
    --------
    >>> from lmmetrics import convert
    >>> round(convert.bits_to_nats(1.0), 6)
    0.693147
    """
    return x * LN2


def bpc_from_perplexity(ppl: float, num_tokens: int, num_chars: int) -> float:
    """Bits per character of a text scored with a token-level perplexity.

    ``BPC = N / T * ln(PPL) / ln 2`` for N tokens spelling T characters.

    Parameters
    ----------
    ppl : float
        Token-level perplexity.
    num_tokens : int
        N, tokens scored.
    num_chars : int
        T, characters of the text.

    Returns
    -------
    float

    Examples
    --------
    >>> from lmmetrics import convert
    >>> round(convert.bpc_from_perplexity(16.0, 100, 400), 6)     # 4 bits a token, 4 characters a token
    1.0
    """
    if float(ppl) == math.inf:  # (the mean NLL passed ~709.78 nats: the BPC is finite but lost)
        raise ValueError("ppl is inf: a perplexity past float64's range no longer says its mean NLL; take "
                         "the bits per character from the NLL itself (lmmetrics.bits_per_character, or "
                         "num_tokens / num_chars * nats_to_bits(cross_entropy))")
    if not 1 <= float(ppl) < math.inf:  # (exp of a mean NLL >= 0)
        raise ValueError(f"ppl must be a perplexity, a finite number >= 1, got {ppl!r}")
    return (check_positive_int("num_tokens", num_tokens) / check_positive_int("num_chars", num_chars)
            * math.log(ppl) / LN2)


def perplexity_from_bpc(bpc: float, num_tokens: int, num_chars: int) -> float:
    """The token-level perplexity matching ``bpc``: ``exp(BPC * ln 2 * T / N)``.

    Parameters
    ----------
    bpc : float
        Bits per character.
    num_tokens : int
        N, tokens scored.
    num_chars : int
        T, characters of the text.

    Returns
    -------
    float

    Examples
    --------
    >>> from lmmetrics import convert
    >>> round(convert.perplexity_from_bpc(1.0, 100, 400), 6)
    16.0
    """
    if not 0 <= float(bpc) < math.inf:
        raise ValueError(f"bpc must be a finite number >= 0, got {bpc!r}")
    return exp(float(bpc) * LN2 * check_positive_int("num_chars", num_chars)
               / check_positive_int("num_tokens", num_tokens))


def whole_counts(name: str, counts: Any) -> F64Array:
    """counts (words, bytes, one per document) as float64, or ValueError
    naming ``name`` for what is not a number, bool, negative, infinite, NaN
    or fractional."""
    check_unmasked(counts, name)
    c = np.asarray(counts)
    if c.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be whole counts (integers >= 0), got dtype {c.dtype}")
    c = c.astype(np.float64)
    whole = np.isfinite(c) & (c >= 0) & (c == np.floor(c))
    if not whole.all():
        raise ValueError(f"{name} must be whole counts (integers >= 0), got {float(c[~whole].flat[0])!r}")
    return c


def _counts(name: str, counts: Optional[Sequence[int]], n: int) -> Optional[float]:
    if counts is None:
        return None
    c = whole_counts(name, counts)
    if c.ndim == 0:
        c = c.reshape(1) if n == 1 else c
    if c.shape != (n,):
        raise ValueError(f"{name} must have one count per log-likelihood ({n}), got shape {c.shape}")
    return float(c.sum())


def corpus_metrics(loglikelihoods: Sequence[float], *, words: Optional[Sequence[int]] = None,
                   bytes: Optional[Sequence[int]] = None) -> Dict[str, Optional[float]]:
    """Aggregate per-document log-likelihoods as lm-evaluation-harness does
    for rolling loglikelihood tasks: the sum of log-likelihoods over the sum
    of counts (not a mean of per-document ratios).

    Parameters
    ----------
    loglikelihoods : sequence of float
        Natural-log totals per document (<= 0).
    words : sequence of int, optional
        Words per document.
    bytes : sequence of int, optional
        UTF-8 bytes per document.

    Returns
    -------
    dict
        ``word_perplexity = exp(-sum LL / sum words)``, ``byte_perplexity =
        exp(-sum LL / sum bytes)`` and ``bits_per_byte = -sum LL / (sum bytes
        * ln 2)``; a value is None when its counts were not given, inf when
        they sum to 0 (as bits per byte with no byte counted).

    Raises
    ------
    ValueError
        A log-likelihood that is NaN or above 0 (negated NLLs are
        log-likelihoods), counts that are not one per log-likelihood, or not
        whole numbers >= 0.

    Examples
    --------
    >>> from lmmetrics import convert
    >>> m = convert.corpus_metrics([-2301.5, -1807.25], words=[402, 310], bytes=[2310, 1751])
    >>> round(m["word_perplexity"], 2), round(m["bits_per_byte"], 4)
    (320.77, 1.4597)
    """
    check_unmasked(loglikelihoods, "loglikelihoods")
    ll = np.asarray(loglikelihoods, dtype=np.float64).reshape(-1)
    if np.isnan(ll).any():
        raise ValueError("loglikelihoods contain NaN")
    if (ll > 0).any():  # (a sign slip would give a perplexity below 1)
        raise ValueError(f"loglikelihoods must be <= 0 (log-probabilities), got {float(ll[ll > 0][0])!r}; "
                         f"for NLLs pass their negatives")
    nll = 0.0 - float(ll.sum())  # (0.0 - x: no -0.0 bits per byte for log-likelihoods of 0)
    n_words = _counts("words", words, ll.size)
    n_bytes = _counts("bytes", bytes, ll.size)

    def perplexity(count: Optional[float]) -> Optional[float]:
        if count is None:
            return None
        return exp(nll / count) if count else math.inf

    return {
        "word_perplexity": perplexity(n_words),
        "byte_perplexity": perplexity(n_bytes),
        "bits_per_byte": None if n_bytes is None else bits_per_unit(nll, n_bytes),
    }
