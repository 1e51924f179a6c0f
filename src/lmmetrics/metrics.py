"""Per-token and corpus metrics from logits and targets.

All functions take logits shaped (..., V) and integer targets shaped (...):
numpy arrays (float32, float64, float16, ml_dtypes.bfloat16) or torch CPU
tensors, read in place. A target equal to ``ignore_index``, and every
negative target, is ignored: it is not read and counts nowhere. Values are
in nats unless the name says bits.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _engine
from ._inputs import as_table
from .convert import LN2, exp
_REDUCTIONS = ("mean", "sum", "none")


def _per_position(values: np.ndarray, res: _engine.RowResults, dtype=None):
    """Per-row values shaped like the logits without their vocabulary axis;
    a torch tensor on the logits' device when the logits are a tensor."""
    if dtype is None:
        dtype = np.float64 if res.dtype == "float64" else np.float32
    arr = values.astype(dtype, copy=False).reshape(res.lead_shape)
    if res.device is not None:
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr)).to(res.device)
    return arr


def _nll(logits, targets, ignore_index, softcap, num_threads) -> _engine.RowResults:
    return _engine.run(logits, targets, ignore_index=ignore_index, softcap=softcap,
                       num_threads=num_threads, nll=True)


def _mean(total: float, count: int) -> float:
    return total / count if count else float("nan")


def token_nll(logits: Any, targets: Any, *, ignore_index: int = -100, softcap: Optional[float] = None,
              num_threads: Optional[int] = None):
    """Negative log-likelihood of each target in nats, shaped like ``targets``.

    ``nll = logsumexp(z) - z[y]``, 0.0 where the target is ignored. float32
    for 16- and 32-bit logits, float64 for float64 logits; a torch tensor when
    the logits are a torch tensor.

    >>> import numpy as np
    >>> token_nll(np.log(np.array([[0.5, 0.25, 0.25]], np.float32)), np.array([0]))
    array([0.6931472], dtype=float32)
    """
    res = _nll(logits, targets, ignore_index, softcap, num_threads)
    return _per_position(res.nll, res)


def cross_entropy(logits: Any, targets: Any, *, reduction: str = "mean", ignore_index: int = -100,
                  softcap: Optional[float] = None, num_threads: Optional[int] = None):
    """Cross-entropy in nats, as ``torch.nn.functional.cross_entropy``.

    ``reduction="mean"`` averages over counted tokens (nan when none is
    counted), ``"sum"`` adds them, ``"none"`` returns :func:`token_nll`.
    Sums are taken in float64 over per-row float64 values in row order
    (compensated), so they do not depend on the thread count.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    res = _nll(logits, targets, ignore_index, softcap, num_threads)
    if reduction == "none":
        return _per_position(res.nll, res)
    if reduction == "sum":
        return res.nll_sum
    return _mean(res.nll_sum, res.n_counted)


def perplexity(logits: Any, targets: Any, *, ignore_index: int = -100, softcap: Optional[float] = None,
               num_threads: Optional[int] = None) -> float:
    """exp(mean NLL) over counted tokens."""
    return exp(cross_entropy(logits, targets, ignore_index=ignore_index, softcap=softcap,
                                  num_threads=num_threads))


def bits_per_token(logits: Any, targets: Any, *, ignore_index: int = -100, softcap: Optional[float] = None,
                   num_threads: Optional[int] = None) -> float:
    """Mean NLL in bits: cross-entropy / ln 2."""
    return cross_entropy(logits, targets, ignore_index=ignore_index, softcap=softcap,
                         num_threads=num_threads) / LN2


def unit_sums(res: _engine.RowResults, table: np.ndarray):
    """(sum table[target], sum NLL of the tokens whose entry is > 0) over
    counted tokens: bytes (or characters) and the NLL that goes with them."""
    units = np.where(res.counted, table[np.where(res.counted, res.targets, 0)], 0)
    return int(units.sum()), float(np.sum(res.nll[units > 0]))


def _per_unit(res: _engine.RowResults, table: np.ndarray, skip_zero: bool) -> float:
    """sum NLL / (ln 2 * sum table[target]) over counted tokens; with
    skip_zero, tokens whose table entry is 0 leave both sums."""
    total_units, nll_with_units = unit_sums(res, table)
    if total_units == 0:
        return float("inf")
    return (nll_with_units if skip_zero else res.nll_sum) / (LN2 * total_units)


def bits_per_byte(logits: Any, targets: Any, token_bytes: Any, *, ignore_index: int = -100,
                  softcap: Optional[float] = None, num_threads: Optional[int] = None) -> float:
    """Bits per byte with nanochat's semantics.

    ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for special
    tokens. Ignored positions and positions whose target has 0 bytes leave
    both sums: ``sum NLL / (ln 2 * sum bytes)``; ``inf`` when no byte counted.
    """
    res = _nll(logits, targets, ignore_index, softcap, num_threads)
    return _per_unit(res, as_table(token_bytes, res.n_cols, "token_bytes"), skip_zero=True)


def bits_per_character(logits: Any, targets: Any, *, token_chars: Any = None, ignore_index: int = -100,
                       softcap: Optional[float] = None, num_threads: Optional[int] = None) -> float:
    """Bits per character.

    Without ``token_chars`` the model is character-level and this equals
    :func:`bits_per_token`. With ``token_chars[v]``, the number of characters
    of token ``v``, it is ``sum NLL / (ln 2 * sum chars)`` over counted tokens
    (= N/T * ln(PPL) / ln 2 for N tokens spelling T characters); ``inf`` when
    no character was counted.
    """
    res = _nll(logits, targets, ignore_index, softcap, num_threads)
    if token_chars is None:
        return _mean(res.nll_sum, res.n_counted) / LN2
    return _per_unit(res, as_table(token_chars, res.n_cols, "token_chars"), skip_zero=False)


def token_entropy(logits: Any, *, softcap: Optional[float] = None, num_threads: Optional[int] = None):
    """Predictive entropy ``-sum p log p`` of each row in nats, shaped like
    the logits without their vocabulary axis (``p = softmax(logits)``;
    entries of probability 0, from -inf logits, add nothing)."""
    res = _engine.run(logits, softcap=softcap, num_threads=num_threads, entropy=True)
    return _per_position(res.entropy, res)


def token_kl(reference_logits: Any, logits: Any, *, num_threads: Optional[int] = None):
    """``KL(softmax(reference_logits) || softmax(logits))`` of each row in
    nats, shaped like the logits without their vocabulary axis. Both inputs
    have the same shape and dtype; the reference is the distribution the
    expectation is taken over (the base model when judging a quantized one).
    ``inf`` where the reference gives mass to an entry the model rules out."""
    res = _engine.run(logits, reference=reference_logits, num_threads=num_threads, kl=True)
    return _per_position(res.kl, res)


def kl_divergence(reference_logits: Any, logits: Any, *, reduction: str = "mean",
                  num_threads: Optional[int] = None):
    """KL(P_ref || P_model) over rows: ``"mean"`` (nats per row), ``"sum"``
    or ``"none"`` (as :func:`token_kl`). Sums are taken in float64."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    res = _engine.run(logits, reference=reference_logits, num_threads=num_threads, kl=True)
    if reduction == "none":
        return _per_position(res.kl, res)
    total = float(np.sum(res.kl))
    return total if reduction == "sum" else _mean(total, res.kl.size)
