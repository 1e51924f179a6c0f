"""Information measures over explicit probability vectors (last axis).

``0 log 0 = 0``. Inputs must be non-negative and each row must sum to 1
within ``atol``; otherwise ValueError. Results are in units of ``base``
(2: bits, e: nats), one value per row (a float for a 1-D input).
"""
from __future__ import annotations

import math
from typing import Any, Union, cast

import numpy as np
import numpy.typing as npt

from ._engine.device import is_torch
from ._engine.types import F64Array

__all__ = ["entropy", "cross_entropy", "kl_divergence", "perplexity"]


def _dist(p: npt.ArrayLike, name: str, atol: float) -> F64Array:
    try:  # (a number, or a 0-d array or tensor; not a bool or a string)
        tol = math.nan if isinstance(atol, (bool, str, bytes)) else float(atol)
    except (TypeError, ValueError):
        tol = math.nan
    if not 0 <= tol < math.inf:
        raise ValueError(f"atol must be a finite number >= 0, got {atol!r}")
    if is_torch(p):  # (any real dtype, bfloat16 included, on any device)
        t = cast(Any, p).detach()
        if t.is_complex():
            raise TypeError(f"{name} must hold real probabilities, got dtype {t.dtype}")
        p = t.cpu().double().numpy()
    raw = np.asarray(p)
    if raw.dtype.kind not in "biuf":  # (complex: numpy would drop the imaginary part with a warning)
        raise TypeError(f"{name} must hold real probabilities, got dtype {raw.dtype}")
    a = raw.astype(np.float64)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last axis of probabilities")
    if np.isnan(a).any():
        raise ValueError(f"{name} contains NaN")
    if (a < 0).any():
        raise ValueError(f"{name} has negative entries")
    sums = a.sum(axis=-1)
    bad = np.abs(sums - 1.0) > tol
    if bad.any():
        raise ValueError(f"{name} rows must sum to 1 (within {tol}); a row sums to {float(sums[bad].flat[0])!r}")
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


def entropy(p: npt.ArrayLike, base: float = 2, *, atol: float = 1e-6) -> Union[float, F64Array]:
    """Entropy ``H(P) = -sum p log p`` (0 log 0 = 0).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float, default 1e-6
        How far a row's sum may be from 1.

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
                  atol: float = 1e-6) -> Union[float, F64Array]:
    """Cross-entropy ``CE(P, Q) = -sum p log q`` (inf where q = 0 < p).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    q : array_like
        Probabilities, the shape of ``p``.
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float, default 1e-6
        How far a row's sum may be from 1.

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
                  atol: float = 1e-6) -> Union[float, F64Array]:
    """``D_KL(P || Q) = sum p log(p / q) = CE(P, Q) - H(P)`` (inf where q = 0 < p).

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    q : array_like
        Probabilities, the shape of ``p``.
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float, default 1e-6
        How far a row's sum may be from 1.

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
    return _out((_xlogy(a, a) - _xlogy(a, b)).sum(axis=-1) / _log(base))


def perplexity(p: npt.ArrayLike, base: float = 2, *, atol: float = 1e-6) -> Union[float, F64Array]:
    """``base ** H(P)``: the effective number of equally likely outcomes.

    Parameters
    ----------
    p : array_like
        Probabilities along the last axis (rows summing to 1 within ``atol``).
    base : float, default 2
        The logarithm's base (2: bits; ``math.e``: nats).
    atol : float, default 1e-6
        How far a row's sum may be from 1.

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
