"""Where the target ranks, and how well the model's confidence is calibrated.

The rank of a target is the number of logits in its row that come before
it when the row is sorted by decreasing logit, ties broken by index (the
lower index first, as ``argmax`` breaks them): the logits greater than the
target's, plus those equal to it at a lower index. So rank 0 is exactly
the first argmax, top-1 accuracy is the accuracy of ``evaluate`` (and
torchmetrics' ``multiclass_accuracy(top_k=1)``), and a target tied with the
max ranks after the tied tokens before it. The native kernel counts it in
the same read that gives the NLL.
The confidence of a position is the top token's probability,
``exp(max - logsumexp)``. Calibration sets the confidence against whether
the first argmax is the target (the kernel's first-argmax rule), in
equal-width bins over [0, 1].

Options and inputs are those of `lmmetrics.token_nll`: logits may be
numpy arrays, torch tensors, model outputs or `lmmetrics.projected`
lazy logits; ``ignore_index``, ``shift``, ``softcap`` and ``num_threads``
mean the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union, overload

import numpy as np

from . import _engine
from ._engine.checks import check_positive_int
from ._engine.inputs import check_unmasked
from ._engine.types import BoolArray, F64Array, FloatArray, I64Array, NllOptions, NumpyLogits
from .metrics import _per_position, as_output

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

__all__ = ["token_rank", "top_k_accuracy", "mean_reciprocal_rank", "token_confidence",
           "expected_calibration_error", "calibration", "Calibration"]

#: The most calibration bins: every bin is a count and a sum in each batch's
#: pass, in ``state_dict`` and in an all-reduce, empty or not; 100,000 bins of
#: width 1e-5 are already finer than any evaluation set fills.
MAX_BINS = 100_000

#: A confidence this close below a bin edge (relative) counts at the edge:
#: a row whose top k logits tie, the rest ruled out, has confidence exactly
#: 1/k, which ``exp(-ln k)`` gives up to a few ulps low (1/10 as
#: 0.09999999999999998, in the bin below 0.1 where torchmetrics and exact
#: arithmetic put it). It moves at most 1e-8 of a bin of 100,000.
EDGE_RTOL = 1e-13


def _ranks(logits: Any, targets: Any, ignore_index: Optional[int], shift: Optional[bool], softcap: Optional[float],
           num_threads: Optional[int]) -> _engine.RowResults:
    return _engine.run(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                       num_threads=num_threads, rank=True)


@overload
def token_rank(logits: torch.Tensor, targets: Any, **options: Unpack[NllOptions]) -> torch.Tensor: ...
@overload
def token_rank(logits: NumpyLogits, targets: Any, **options: Unpack[NllOptions]) -> I64Array: ...
@overload
def token_rank(logits: Any, targets: Any, **options: Unpack[NllOptions]) -> Union[I64Array, torch.Tensor]: ...


def token_rank(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
               softcap: Optional[float] = None, num_threads: Optional[int] = None) -> Union[I64Array, torch.Tensor]:
    """The rank of each target: how many logits of its row come before it.

    Those greater than the target's logit, and those equal to it at a lower
    index: ties are broken by index like ``argmax``, so the rank is 0
    exactly where the first argmax is the target, and equal logits take
    distinct ranks in index order. With a softcap the capped logits are
    compared, as the kernel holds them (float lanes for 16- and 32-bit
    logits, double for float64).

    Parameters
    ----------
    logits : array_like, torch.Tensor, model output or Projected
        Logits shaped (..., V), as `lmmetrics.token_nll` takes them.
    targets : array_like or torch.Tensor
        Integer token ids shaped like the logits without their last axis.
    ignore_index : int or None, default -100
        Targets equal to it (and negative targets) are not counted.
    shift : bool or None, default None
        ``True`` for unshifted labels (position t scored against
        ``targets[..., t + 1]``), as in `lmmetrics.token_nll`.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit first.
    num_threads : int or None, default None
        CPU threads; the result does not depend on it.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        int64, shaped like ``targets`` (``targets[..., 1:]`` with
        ``shift=True``), -1 where the target is ignored; a tensor on the
        logits' device when the logits are a tensor.

    Raises
    ------
    ValueError
        A counted target >= V, mismatched shapes, NaN in the logits of a
        counted position, a counted row all -inf, or an option out of range.
    TypeError
        Integer logits or float targets.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.array([[2.0, 1.0, 3.0], [0.0, 5.0, 5.0]], np.float32)
    >>> lmmetrics.token_rank(logits, np.array([0, 1]))
    array([1, 0])
    >>> lmmetrics.token_rank(logits, np.array([1, -100]))
    array([ 2, -1])
    >>> lmmetrics.token_rank(logits[[1, 1]], np.array([1, 2]))   # a tie: the lower index first
    array([0, 1])
    """
    res = _ranks(logits, targets, ignore_index, shift, softcap, num_threads)
    return as_output(res.indices("rank").reshape(res.lead_shape), res)


def top_k_accuracy(logits: Any, targets: Any, k: int = 5, *, ignore_index: Optional[int] = -100,
                   shift: Optional[bool] = None, softcap: Optional[float] = None,
                   num_threads: Optional[int] = None) -> float:
    """The share of counted targets among the ``k`` largest logits (rank < k).

    Ties are broken by index, as in ``token_rank``: the top k are the
    first k of the row sorted by decreasing logit, the lower index first
    among equal logits, so ``k=1`` gives the accuracy of
    ``lmmetrics.evaluate`` (the first argmax is the target).

    Parameters
    ----------
    logits : array_like, torch.Tensor, model output or Projected
        Logits shaped (..., V), as `lmmetrics.token_nll` takes them.
    targets : array_like or torch.Tensor
        Integer token ids shaped like the logits without their last axis.
    k : int, default 5
        How many of the largest logits count, in [1, V].
    ignore_index, shift, softcap, num_threads
        As in `token_rank`.

    Returns
    -------
    float
        In [0, 1]; NaN when no target is counted.

    Raises
    ------
    ValueError
        ``k`` not an integer in [1, V], or what `token_rank` raises.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.array([[2.0, 1.0, 3.0], [0.0, 5.0, 4.0]], np.float32)
    >>> lmmetrics.top_k_accuracy(logits, np.array([0, 0]), k=2)
    0.5
    """
    k = check_positive_int("k", k)
    res = _ranks(logits, targets, ignore_index, shift, softcap, num_threads)
    if k > res.n_cols:
        raise ValueError(f"k must be at most the vocabulary size {res.n_cols}, got {k}")
    rank = res.indices("rank")[res.counted]
    return float(np.count_nonzero(rank < k)) / rank.size if rank.size else float("nan")


def mean_reciprocal_rank(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100,
                         shift: Optional[bool] = None, softcap: Optional[float] = None,
                         num_threads: Optional[int] = None) -> float:
    """The mean of ``1 / (rank + 1)`` over the counted targets.

    Parameters
    ----------
    logits : array_like, torch.Tensor, model output or Projected
        Logits shaped (..., V), as `lmmetrics.token_nll` takes them.
    targets : array_like or torch.Tensor
        Integer token ids shaped like the logits without their last axis.
    ignore_index, shift, softcap, num_threads
        As in `token_rank`.

    Returns
    -------
    float
        In (0, 1]; NaN when no target is counted.

    Raises
    ------
    ValueError
        What `token_rank` raises.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.array([[2.0, 1.0, 3.0], [0.0, 5.0, 4.0]], np.float32)
    >>> lmmetrics.mean_reciprocal_rank(logits, np.array([2, 2]))   # (1 + 1/2) / 2
    0.75
    """
    res = _ranks(logits, targets, ignore_index, shift, softcap, num_threads)
    rank = res.indices("rank")[res.counted]
    return float(np.mean(1.0 / (rank + 1.0))) if rank.size else float("nan")


@overload
def token_confidence(logits: torch.Tensor, *, shift: Optional[bool] = ..., softcap: Optional[float] = ...,
                     num_threads: Optional[int] = ...) -> torch.Tensor: ...
@overload
def token_confidence(logits: NumpyLogits, *, shift: Optional[bool] = ..., softcap: Optional[float] = ...,
                     num_threads: Optional[int] = ...) -> FloatArray: ...
@overload
def token_confidence(logits: Any, *, shift: Optional[bool] = ..., softcap: Optional[float] = ...,
                     num_threads: Optional[int] = ...) -> Union[FloatArray, torch.Tensor]: ...


def token_confidence(logits: Any, *, shift: Optional[bool] = None, softcap: Optional[float] = None,
                     num_threads: Optional[int] = None) -> Union[FloatArray, torch.Tensor]:
    """The top token's probability at each position, ``exp(max - logsumexp)``.

    Parameters
    ----------
    logits : array_like, torch.Tensor, model output or Projected
        Logits shaped (..., V), as `lmmetrics.token_nll` takes them.
    shift : bool or None, default None
        ``True`` drops each sequence's last position (which predicts no
        target), as `lmmetrics.token_nll` does with ``shift=True``.
    softcap, num_threads
        As in `token_rank`.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shaped like the logits without their vocabulary axis, in (0, 1];
        float32 (float64 for float64 logits), a tensor on the logits' device
        for a tensor.

    Raises
    ------
    ValueError
        NaN in the logits, a row that is all -inf, or an option out of range.
    TypeError
        Integer logits.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], np.float32))
    >>> lmmetrics.token_confidence(logits)
    array([0.5, 0.8], dtype=float32)
    """
    res = _engine.run(logits, shift=shift, softcap=softcap, num_threads=num_threads, top_logprob=True)
    return _per_position(np.exp(res.floats("top_logprob")), res)


@dataclass(frozen=True)
class Calibration:
    """Reliability-diagram data: per equal-width confidence bin, how many
    counted tokens fell in it, their summed confidence and how many were
    correct (the first argmax is the target).

    Bin ``b`` holds confidences in ``[edges[b], edges[b + 1])``, the last
    bin ``[edges[-2], 1]``; a confidence within 1e-13 (relative) below an
    edge counts at the edge (a row whose top k logits tie, the rest ruled
    out, has confidence exactly 1/k, which ``exp(-ln k)`` rounds a few ulps
    low: 1/10 would fall below the edge 0.1). The state is counts and float64 sums, so
    results of batches merge exactly (`add`); build it from per-token
    arrays with `from_arrays`.

    Examples
    --------
    >>> import numpy as np
    >>> from lmmetrics import Calibration
    >>> a = Calibration.from_arrays(np.array([0.9, 0.3]), np.array([True, False]), bins=2)
    >>> b = Calibration.from_arrays(np.array([1.0]), np.array([True]), bins=2)
    >>> c = a.add(b)
    >>> c.counts.tolist(), c.accuracy.tolist()
    ([1, 2], [0.0, 1.0])
    >>> round(c.ece, 6)    # (1 * 0.3 + 2 * 0.05) / 3
    0.133333
    """

    edges: F64Array         #: bins + 1 bin edges, 0 to 1
    counts: I64Array        #: counted tokens in each bin
    conf_sum: F64Array      #: summed confidence in each bin
    correct: I64Array       #: tokens whose first argmax is the target, in each bin

    @classmethod
    def from_arrays(cls, confidence: Any, correct: Any, bins: int = 15) -> Calibration:
        """The bins of per-token confidences (in [0, 1]) and correctness
        (a confidence within 1e-13, relative, below an edge at the edge).

        Raises ValueError for bins that is not an integer from 1 to
        100,000 (TypeError for a non-integer), arrays of
        different sizes, confidences outside [0, 1] or NaN, or correctness
        values other than booleans, 0 and 1.
        """
        n = _check_bins(bins)
        check_unmasked(confidence, "confidence")
        check_unmasked(correct, "correct")
        conf = np.asarray(confidence, np.float64).reshape(-1)
        given = np.asarray(correct).reshape(-1)
        ok: BoolArray = given.astype(bool)
        if given.dtype != bool and not np.array_equal(given, ok):  # (0.5 or NaN is not a correctness)
            raise ValueError("correct must hold booleans (or 0 and 1)")
        if conf.size != ok.size:
            raise ValueError(f"confidence holds {conf.size} values and correct {ok.size}")
        if conf.size and not (np.all(conf >= 0.0) and np.all(conf <= 1.0)):
            raise ValueError("confidence must lie in [0, 1] (and not be NaN)")
        edges = np.linspace(0.0, 1.0, n + 1)
        # bin b: edges[b] <= c < edges[b + 1], the last one closed; c within EDGE_RTOL below an edge at it
        which = np.minimum(np.searchsorted(edges, conf * (1.0 + EDGE_RTOL), side="right") - 1, n - 1)
        conf_sum: F64Array = np.bincount(which, conf, minlength=n).astype(np.float64)
        return cls(edges, np.bincount(which, minlength=n).astype(np.int64), conf_sum,
                   np.bincount(which, ok, minlength=n).astype(np.int64))

    def add(self, other: Calibration) -> Calibration:
        """The bins of both (same edges): counts and sums added."""
        if not np.array_equal(self.edges, other.edges):
            raise ValueError(f"cannot add calibrations with {self.bins} and {other.bins} bins")
        return Calibration(self.edges, self.counts + other.counts, self.conf_sum + other.conf_sum,
                           self.correct + other.correct)

    @property
    def bins(self) -> int:
        return int(self.counts.size)

    @property
    def total(self) -> int:
        """Counted tokens in all bins."""
        return int(self.counts.sum())

    @property
    def confidence(self) -> F64Array:
        """Mean confidence in each bin (NaN where empty)."""
        return _ratio(self.conf_sum, self.counts)

    @property
    def accuracy(self) -> F64Array:
        """Share of correct tokens in each bin (NaN where empty)."""
        return _ratio(self.correct.astype(np.float64), self.counts)

    @property
    def ece(self) -> float:
        """Expected calibration error: sum over bins of the bin's share of
        tokens times |accuracy - mean confidence| (NaN without tokens)."""
        n = self.total
        if not n:
            return float("nan")
        gap = np.abs(self.correct - self.conf_sum)  # = count * |accuracy - confidence|
        return float(gap.sum() / n)


def _ratio(num: F64Array, den: I64Array) -> F64Array:
    with np.errstate(invalid="ignore", divide="ignore"):
        out: F64Array = np.where(den > 0, num / np.maximum(den, 1), np.nan)
    return out


def _check_bins(bins: object, name: str = "bins") -> int:
    """bins as an int in [1, MAX_BINS]: TypeError for what is not an
    integer, ValueError outside the range (checked before any array is
    sized by it)."""
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(bins).__name__}")
    n = check_positive_int(name, bins)
    if n > MAX_BINS:
        raise ValueError(f"{name} must be at most {MAX_BINS:,} (each bin is stored, empty or not), got {n}")
    return n


def calibration(logits: Any, targets: Any, bins: int = 15, *, ignore_index: Optional[int] = -100,
                shift: Optional[bool] = None, softcap: Optional[float] = None,
                num_threads: Optional[int] = None) -> Calibration:
    """The reliability diagram of the counted tokens, in one read of the logits.

    Confidence is the top token's probability; a token is correct when the
    first argmax of its row is the target.

    Parameters
    ----------
    logits : array_like, torch.Tensor, model output or Projected
        Logits shaped (..., V), as `lmmetrics.token_nll` takes them.
    targets : array_like or torch.Tensor
        Integer token ids shaped like the logits without their last axis.
    bins : int, default 15
        Equal-width bins over [0, 1], the last one closed; at most
        100,000 (each bin is stored, empty or not).
    ignore_index, shift, softcap, num_threads
        As in `token_rank`.

    Returns
    -------
    Calibration
        Bin edges, counts, mean confidence, accuracy and ``ece``.

    Raises
    ------
    TypeError
        ``bins`` not an integer, integer logits or float targets.
    ValueError
        ``bins`` < 1 or above 100,000, or what `token_rank` raises.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.log(np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]], np.float32))
    >>> cal = lmmetrics.calibration(logits, np.array([0, 1, 1]), bins=2)
    >>> cal.counts.tolist(), cal.accuracy.tolist()
    ([0, 3], [nan, 0.6666666666666666])
    """
    n = _check_bins(bins)
    res = _engine.run(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                      num_threads=num_threads, argmax=True, top_logprob=True)
    return calibration_of(res, n)


def calibration_of(res: _engine.RowResults, bins: int) -> Calibration:
    """The bins of a pass's counted rows (the pass computed argmax and
    top_logprob): the top token's probability against top-1 correctness."""
    counted = res.counted
    conf: F64Array = np.exp(res.floats("top_logprob")[counted])
    correct: BoolArray = res.indices("argmax")[counted] == res.target_ids[counted]
    return Calibration.from_arrays(conf, correct, bins)


def expected_calibration_error(logits: Any, targets: Any, bins: int = 15, *, ignore_index: Optional[int] = -100,
                               shift: Optional[bool] = None, softcap: Optional[float] = None,
                               num_threads: Optional[int] = None) -> float:
    """Expected calibration error of the top token's probability.

    ``ECE = sum_b (n_b / n) |accuracy_b - confidence_b|`` over equal-width
    bins of [0, 1] (the last one closed), as `calibration` bins it.

    Parameters
    ----------
    logits, targets, bins, ignore_index, shift, softcap, num_threads
        As in `calibration`.

    Returns
    -------
    float
        In [0, 1]; NaN when no token is counted.

    Raises
    ------
    TypeError, ValueError
        As `calibration` raises them.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.log(np.array([[0.9, 0.1], [0.6, 0.4]], np.float32))
    >>> round(lmmetrics.expected_calibration_error(logits, np.array([0, 1]), bins=2), 6)   # |0.5 - 0.75|
    0.25
    """
    return calibration(logits, targets, bins, ignore_index=ignore_index, shift=shift, softcap=softcap,
                       num_threads=num_threads).ece
