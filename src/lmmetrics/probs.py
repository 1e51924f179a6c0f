"""Information measures over explicit probability vectors (last axis).

``0 log 0 = 0``. Inputs must be non-negative and each row must sum to 1
within ``atol``; otherwise ValueError. ``atol=None`` (the default) is 1e-6
plus what the input's float type adds to a row's sum in rounding each
entry: its ``eps`` (9.8e-4 for float16, 7.8e-3 for bfloat16, 1.2e-7 for
float32) and half its smallest subnormal per entry (3e-8 for float16), so
that the probabilities of a 16-bit softmax are taken as they are. Results are in units of ``base``
(2: bits, e: nats), one value per row (a float for a 1-D input).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional, Union, cast

import numpy as np
import numpy.typing as npt

from ._engine.device import is_torch
from ._engine.inputs import check_unmasked, torch_values
from ._engine.types import F64Array

__all__ = ["entropy", "cross_entropy", "kl_divergence", "perplexity"]

#: bfloat16's eps and smallest normal (numpy's finfo does not know ml_dtypes' type)
_BF16 = SimpleNamespace(eps=2.0 ** -7, tiny=2.0 ** -126)


def _dist(p: npt.ArrayLike, name: str, atol: Optional[float]) -> F64Array:
    if atol is None:
        tol = math.nan  # (set from the input's float type below)
    else:
        try:  # (a number, or a 0-d array or tensor; not a bool or a string)
            tol = math.nan if isinstance(atol, (bool, str, bytes)) else float(atol)
        except (TypeError, ValueError):
            tol = math.nan
        if not 0 <= tol < math.inf:
            raise ValueError(f"atol must be a finite number >= 0 or None, got {atol!r}")
    info: Any = None  # (the input's float type: its eps and smallest normal; None: exact)
    if is_torch(p):  # (any real dtype, bfloat16 included, on any device)
        t = torch_values(cast(Any, p), name)  # (a negative view's memory holds its values negated)
        if t.is_complex():
            raise TypeError(f"{name} must hold real probabilities, got dtype {t.dtype}")
        if t.is_floating_point():
            import torch

            info = torch.finfo(t.dtype)
        raw = t.cpu().double().numpy()
    else:
        check_unmasked(p, name)
        raw = np.asarray(p)
        if raw.dtype.kind == "f":
            info = np.finfo(raw.dtype)
        elif raw.dtype.name == "bfloat16":  # (ml_dtypes': numpy's kind "V"; float32's exponent, 8 bits)
            info = _BF16
        elif raw.dtype.kind not in "biu":  # (complex: numpy would drop the imaginary part with a warning)
            raise TypeError(f"{name} must hold real probabilities, got dtype {raw.dtype}")
    a: F64Array = raw.astype(np.float64)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last axis of probabilities")
    if np.isnan(a).any():
        raise ValueError(f"{name} contains NaN")
    if (a < 0).any():
        raise ValueError(f"{name} has negative entries (log-probabilities? pass their exp)")
    if atol is None:
        # (rounding each entry to the input's type moves a row's sum by at
        # most eps/2 of it, and by half the smallest subnormal, tiny * eps,
        # an entry: eps, for rounding in the steps that made them too)
        eps, tiny = (0.0, 0.0) if info is None else (float(info.eps), float(info.tiny))
        tol = 1e-6 + eps + a.shape[-1] * tiny * eps / 2
    sums = a.sum(axis=-1)
    bad = np.abs(sums - 1.0) > tol
    if bad.any():
        raise ValueError(f"{name} rows must sum to 1 (within {tol:.3g}); a row sums to "
                         f"{float(sums[bad].flat[0])!r} (atol= sets how far a sum may be from 1)")
    return a


def _log(base: float) -> float:
    b = float(base)
    if not 0 < b < math.inf or b == 1:
        raise ValueError(f"base must be a finite positive number other than 1, got {base!r}")
    return math.log(b)


def _out(x: F64Array) -> Union[float, F64Array]:
    return float(x) if x.ndim == 0 else x


def _xlogy(x: F64Array, y: F64Array) -> F64Array:
    """x * log(y) with 0 * log(anything) = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, x * np.log(np.where(x > 0, y, 1.0)), 0.0)


def _rel_entr(x: F64Array, y: F64Array) -> F64Array:
    """x * log(x / y) with 0 * log(anything) = 0, as scipy's rel_entr: for x
    and y within a factor 2, log1p((x - y) / y) (x - y exact), as a log of
    the rounded ratio, or log x - log y, is off by 1e-16 absolute where the
    value is tiny (a KL of 9e-15 came out 0.8% off); elsewhere the log of
    the ratio, or log x - log y where the ratio is not a normal float (y = 0
    < x: inf)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        ratio = x / y
        close = (ratio > 0.5) & (ratio < 2.0)
        normal = (ratio >= np.finfo(np.float64).tiny) & (ratio < math.inf)
        safe_y = np.where(close, y, 1.0)
        log_ratio = np.where(close, np.log1p((np.where(close, x, 1.0) - safe_y) / safe_y),
                             np.where(normal, np.log(np.where(normal, ratio, 1.0)),
                                      np.log(np.where(x > 0, x, 1.0)) - np.log(np.where(x > 0, y, 1.0))))
        return np.where(x > 0, x * log_ratio, 0.0)


def entropy(p: npt.ArrayLike, base: float = 2, *, atol: Optional[float] = None) -> Union[float, F64Array]:
    """Entropy ``H(P) = -sum p log p`` (0 log 0 = 0).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float or None, default None
        How far a row's sum may be from 1; None: 1e-6 plus the rounding of
        the input's float type (see `lmmetrics.probs`).

    Returns
    -------
    float or numpy.ndarray
        One value per row.

    Raises
    ------
    ValueError
        An empty last axis, NaN, negative entries, or a row not summing to 1.

    Examples
    --------
    >>> from lmmetrics import probs
    >>> round(probs.entropy([0.4, 0.4, 0.1, 0.1]), 4)
    1.7219
    """
    a = _dist(p, "p", atol)
    return _out(0.0 - _xlogy(a, a).sum(axis=-1) / _log(base))  # (0.0 - x: no -0.0 for a certain outcome)


def cross_entropy(p: npt.ArrayLike, q: npt.ArrayLike, base: float = 2, *,
                  atol: Optional[float] = None) -> Union[float, F64Array]:
    """Cross-entropy ``CE(P, Q) = -sum p log q`` (inf where q = 0 < p).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    q : array_like
        Probabilities, the shape of ``p``.
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float or None, default None
        How far a row's sum may be from 1; None: 1e-6 plus the rounding of
        the input's float type (see `lmmetrics.probs`).

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        An empty last axis, NaN, negative entries, or a row not summing to 1.

    Examples
    --------
    >>> from lmmetrics import probs
    >>> round(probs.cross_entropy([0.5, 0.5], [0.25, 0.75]), 4)
    1.2075
    """
    a, b = _dist(p, "p", atol), _dist(q, "q", atol)
    if a.shape != b.shape:
        raise ValueError(f"p and q must have the same shape, got {a.shape} and {b.shape}")
    return _out(0.0 - _xlogy(a, b).sum(axis=-1) / _log(base))


def kl_divergence(p: npt.ArrayLike, q: npt.ArrayLike, base: float = 2, *,
                  atol: Optional[float] = None) -> Union[float, F64Array]:
    """``D_KL(P || Q) = sum p log(p / q) = CE(P, Q) - H(P)`` (inf where q = 0 < p).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    q : array_like
        Probabilities, the shape of ``p``.
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float or None, default None
        How far a row's sum may be from 1; None: 1e-6 plus the rounding of
        the input's float type (see `lmmetrics.probs`).

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        An empty last axis, NaN, negative entries, or a row not summing to 1.

    Examples
    --------
    >>> from lmmetrics import probs
    >>> round(probs.kl_divergence([0.4, 0.5, 0.05, 0.05], [0.4, 0.4, 0.1, 0.1]), 5)
    0.06096
    """
    a, b = _dist(p, "p", atol), _dist(q, "q", atol)
    if a.shape != b.shape:
        raise ValueError(f"p and q must have the same shape, got {a.shape} and {b.shape}")
    return _out(_rel_entr(a, b).sum(axis=-1) / _log(base))


def perplexity(p: npt.ArrayLike, base: float = 2, *, atol: Optional[float] = None) -> Union[float, F64Array]:
    """``base ** H(P)``: the effective number of equally likely outcomes.

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float or None, default None
        How far a row's sum may be from 1; None: 1e-6 plus the rounding of
        the input's float type (see `lmmetrics.probs`).

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        An empty last axis, NaN, negative entries, or a row not summing to 1.

    Examples
    --------
    >>> from lmmetrics import probs
    >>> round(probs.perplexity([0.25, 0.25, 0.25, 0.25]), 6)
    4.0
    """
    return _out(np.power(float(base), np.asarray(entropy(p, base, atol=atol))))
