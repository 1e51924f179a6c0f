"""Standard errors from sums kept in float64 (mergeable, all-reducible):
of a mean over tokens, of a ratio of sums (bits per byte), of a mean over
tokens clustered by document; and of a mean over documents, from their
values. Pure functions of sums and values; `lmmetrics.evaluation` keeps
the sums."""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from ._engine.types import F64Array

#: the two-sided 95% normal quantile, Phi^-1(0.975)
Z95 = 1.959963984540054


def mean_stderr(total: float, squares: float, n: int) -> float:
    """The standard error of a mean over ``n`` values from their sum and
    sum of squares: the sample standard deviation (n - 1) over sqrt(n),
    which is llama.cpp's ``sqrt((<x^2> - <x>^2) / (n - 1))``. nan below
    two values or when a sum is nan; inf when a sum is infinite (of either
    sign: a mean of -inf, as a paired difference where the reference rules
    a target out, spreads as far as one of inf)."""
    if n < 2 or math.isnan(total) or math.isnan(squares):
        return math.nan
    if not (math.isfinite(total) and math.isfinite(squares)):
        return math.inf
    mean = total / n
    var = max(squares / n - mean * mean, 0.0) * n / (n - 1)
    return math.sqrt(var / n)


def _to_unit(values: F64Array) -> Tuple[F64Array, int]:
    """``values`` times ``2**-e`` (exact: a power of two), their largest
    magnitude in [0.5, 1), and ``e``: their sums stay within float64."""
    e = math.frexp(float(np.max(np.abs(values))))[1] if values.size else 0
    return np.ldexp(values, -e), e


def sample_mean(values: F64Array) -> float:
    """The mean of finite ``values`` held whole (a value a document), finite
    where their sum passes float64's range; ``np.mean``'s bits otherwise.
    nan for no value or with a NaN, inf with an infinite value."""
    if not values.size:
        return math.nan
    unit, e = _to_unit(values)
    return math.ldexp(float(np.mean(unit)), e)


def finite_mean(mean: float, values: F64Array) -> float:
    """``mean`` (computed from the sum of ``values``), or where it is not
    finite while every value is (their sum passed float64's range: float64
    logits masked with finfo.min), their `sample_mean`."""
    return sample_mean(values) if not math.isfinite(mean) and bool(np.isfinite(values).all()) else mean


def sample_stderr(values: F64Array) -> float:
    """The standard error of the mean of ``values`` held whole (a value a
    document): the sample standard deviation (n - 1) over sqrt(n), as
    `mean_stderr`, but from the deviations themselves (two passes, on the
    values scaled by a power of two, from the first value, and scaled by
    the largest deviation): exactly 0 for equal values, and finite for
    finite values whose squares, or sum, overflow. nan below two values or
    with a NaN; inf with an infinite value."""
    n = int(values.size)
    if n < 2 or np.isnan(values).any():
        return math.nan
    if not np.isfinite(values).all():
        return math.inf
    unit, e = _to_unit(values)
    shifted = unit - unit[0]
    dev = shifted - float(np.mean(shifted))
    scale = float(np.max(np.abs(dev)))
    if scale == 0.0:
        return 0.0
    dev = dev / scale
    try:  # (at most the largest magnitude, but rounding may carry it past float64's top)
        return math.ldexp(scale * math.sqrt(float(np.dot(dev, dev)) / (n - 1) / n), e)
    except OverflowError:
        return math.inf


def ratio_stderr(x: float, y: float, xx: float, xy: float, yy: float, n: int) -> float:
    """The standard error of ``R = sum x / sum y`` over ``n`` paired values
    (x, y) (the delta method, as for any ratio estimator): ``sqrt(n /
    (n - 1) * sum (x - R y)^2) / sum y``, from the sums of x, y, x^2, xy and
    y^2. nan below two values or without y; inf when a sum is."""
    if n < 2 or y <= 0:
        return math.nan
    if not all(math.isfinite(v) for v in (x, xx, xy)):
        return math.inf
    r = x / y
    resid = max(xx - 2.0 * r * xy + r * r * yy, 0.0)
    return math.sqrt(n / (n - 1) * resid) / y


def clustered_stderr(sums: F64Array, counts: F64Array) -> float:
    """The standard error of the mean over tokens ``sum(sums) / sum(counts)``
    when tokens of one document are not independent: documents are the
    units (cluster-robust, with the small-sample factor G / (G - 1)):
    ``sqrt(G / (G - 1) * sum_g (s_g - mean n_g)^2) / N`` over the G
    documents' sums s_g and counts n_g, of the documents with a count: one
    without (no byte, no token with reference logits) holds nothing of the
    mean, as it holds nothing of the macro mean. nan below two documents."""
    held = counts > 0
    sums, counts = sums[held], counts[held]
    g = int(counts.size)
    n = float(np.sum(counts))
    if g < 2 or n <= 0:
        return math.nan
    total = float(np.sum(sums))
    if not math.isfinite(total):
        return math.inf
    resid = sums - (total / n) * counts
    return math.sqrt(g / (g - 1) * float(np.dot(resid, resid))) / n


def interval(center: float, stderr: float) -> Tuple[float, float]:
    """The 95% normal interval ``center -/+ Z95 stderr`` (Z95 = 1.959964...)."""
    return center - Z95 * stderr, center + Z95 * stderr
