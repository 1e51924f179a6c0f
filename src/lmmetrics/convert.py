"""Conversions between the units evaluations report, and corpus aggregation."""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import numpy as np

LN2 = math.log(2.0)


def exp(x: float) -> float:
    """e^x as a float, inf where it overflows (math.exp raises there): a
    perplexity of a mean NLL above ~709.78 nats is inf, not an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


__all__ = ["nats_to_bits", "bits_to_nats", "bpc_from_perplexity", "perplexity_from_bpc", "corpus_metrics"]


def nats_to_bits(x):
    """Nats to bits (divide by ln 2); works on floats and arrays."""
    return x / LN2


def bits_to_nats(x):
    """Bits to nats (multiply by ln 2); works on floats and arrays."""
    return x * LN2


def _positive(name: str, value) -> float:
    v = float(value)
    if not v > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return v


def bpc_from_perplexity(ppl: float, num_tokens: int, num_chars: int) -> float:
    """Bits per character of a text of ``num_chars`` characters scored as
    ``num_tokens`` tokens with token-level perplexity ``ppl``:
    ``BPC = N / T * ln(PPL) / ln 2``."""
    ppl = _positive("ppl", ppl)
    return _positive("num_tokens", num_tokens) / _positive("num_chars", num_chars) * math.log(ppl) / LN2


def perplexity_from_bpc(bpc: float, num_tokens: int, num_chars: int) -> float:
    """The token-level perplexity matching ``bpc``: ``exp(BPC * ln 2 * T / N)``."""
    return exp(float(bpc) * LN2 * _positive("num_chars", num_chars) / _positive("num_tokens", num_tokens))


def _counts(name: str, counts, n: int) -> Optional[float]:
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

    def ratio(count):
        if count is None:
            return None
        return -total / count if count else float("inf")

    per_word, per_byte = ratio(n_words), ratio(n_bytes)
    return {
        "word_perplexity": None if per_word is None else exp(per_word),
        "byte_perplexity": None if per_byte is None else exp(per_byte),
        "bits_per_byte": None if per_byte is None else per_byte / LN2,
    }
