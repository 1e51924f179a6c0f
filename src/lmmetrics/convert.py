"""Conversions between the units evaluations report, and corpus aggregation."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Union, overload

import numpy as np
import numpy.typing as npt

from ._checks import check_positive_int
from ._types import FloatArray

LN2 = math.log(2.0)


def exp(x: float) -> float:
    """e^x as a float, inf where it overflows (math.exp raises there): a
    perplexity of a mean NLL above ~709.78 nats is inf, not an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def bits_per_unit(nll_sum: float, units: float) -> float:
    """Bits per unit (byte, character) of ``units`` units scored with a
    summed NLL of ``nll_sum`` nats: ``nll_sum / (ln 2 * units)``, inf when
    no unit was counted."""
    return nll_sum / (LN2 * units) if units else math.inf


__all__ = ["nats_to_bits", "bits_to_nats", "bpc_from_perplexity", "perplexity_from_bpc", "corpus_metrics"]


@overload
def nats_to_bits(x: float) -> float: ...
@overload
def nats_to_bits(x: npt.NDArray[Any]) -> FloatArray: ...


def nats_to_bits(x: Union[float, npt.NDArray[Any]]) -> Union[float, FloatArray]:
    """Nats to bits (divide by ln 2); works on floats and arrays."""
    return x / LN2


@overload
def bits_to_nats(x: float) -> float: ...
@overload
def bits_to_nats(x: npt.NDArray[Any]) -> FloatArray: ...


def bits_to_nats(x: Union[float, npt.NDArray[Any]]) -> Union[float, FloatArray]:
    """Bits to nats (multiply by ln 2); works on floats and arrays."""
    return x * LN2


def bpc_from_perplexity(ppl: float, num_tokens: int, num_chars: int) -> float:
    """Bits per character of a text of ``num_chars`` characters scored as
    ``num_tokens`` tokens with token-level perplexity ``ppl``:
    ``BPC = N / T * ln(PPL) / ln 2``."""
    if not float(ppl) > 0:
        raise ValueError(f"ppl must be positive, got {ppl!r}")
    return (check_positive_int("num_tokens", num_tokens) / check_positive_int("num_chars", num_chars)
            * math.log(ppl) / LN2)


def perplexity_from_bpc(bpc: float, num_tokens: int, num_chars: int) -> float:
    """The token-level perplexity matching ``bpc``: ``exp(BPC * ln 2 * T / N)``."""
    return exp(float(bpc) * LN2 * check_positive_int("num_chars", num_chars)
               / check_positive_int("num_tokens", num_tokens))


def _counts(name: str, counts: Optional[Sequence[int]], n: int) -> Optional[float]:
    if counts is None:
        return None
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim == 0:
        c = c.reshape(1) if n == 1 else c
    if c.shape != (n,):
        raise ValueError(f"{name} must have one count per log-likelihood ({n}), got shape {c.shape}")
    if (c < 0).any():
        raise ValueError(f"{name} must not be negative")
    return float(c.sum())


def corpus_metrics(loglikelihoods: Sequence[float], *, words: Optional[Sequence[int]] = None,
                   bytes: Optional[Sequence[int]] = None) -> Dict[str, Optional[float]]:
    """Aggregate per-document log-likelihoods as lm-evaluation-harness does for
    rolling loglikelihood tasks: the sum of log-likelihoods over the sum of
    counts (not a mean of per-document ratios).

    ``loglikelihoods`` are natural-log totals per document (<= 0); ``words``
    and ``bytes`` the per-document word and UTF-8 byte counts. Returns
    ``word_perplexity = exp(-sum LL / sum words)``, ``byte_perplexity =
    exp(-sum LL / sum bytes)`` and ``bits_per_byte = -sum LL / (sum bytes * ln 2)``;
    a value is None when its counts were not given.
    """
    ll = np.asarray(loglikelihoods, dtype=np.float64).reshape(-1)
    if np.isnan(ll).any():
        raise ValueError("loglikelihoods contain NaN")
    total = float(ll.sum())
    n_words = _counts("words", words, ll.size)
    n_bytes = _counts("bytes", bytes, ll.size)

    def perplexity(count: Optional[float]) -> Optional[float]:
        if count is None:
            return None
        return exp(-total / count) if count else math.inf

    return {
        "word_perplexity": perplexity(n_words),
        "byte_perplexity": perplexity(n_bytes),
        "bits_per_byte": None if n_bytes is None else bits_per_unit(-total, n_bytes),
    }
