"""Per-token, per-sequence and corpus metrics from logits and targets.

All functions take logits shaped (..., V) and integer targets shaped (...):
numpy arrays (float32, float64, float16, ml_dtypes.bfloat16) or torch
tensors (CPU, read in place; CUDA, computed on their device), or a model
output with ``.logits`` (e.g. transformers' ``CausalLMOutputWithPast``). A
target equal to ``ignore_index``, and every negative target, is ignored: it
is not read and counts nowhere (``ignore_index=None`` ignores the negative
targets only). Values are in nats unless the name says bits.

``shift=True`` takes unshifted inputs as Hugging Face passes them (``labels``
equal to ``input_ids``, -100 where not scored): position t is scored against
``targets[..., t + 1]`` and the last position is dropped, without copying
the logits. Without it, ``targets[..., t]`` is what position t predicts.

These are metrics, not a training loss: tensors that require grad are read
detached, and no gradient flows to the results.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Literal, Optional, Tuple, TypeVar, Union, cast, overload

import numpy as np
import numpy.typing as npt

from . import _engine
from ._engine.inputs import as_table
from ._engine.types import BoolArray, F64Array, FloatArray, I64Array, NllOptions, NumpyLogits, RowOptions
from ._spread import finite_mean
from .convert import LN2, bits_per_unit, exp

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

_REDUCTIONS = ("mean", "sum", "none")
_Values = TypeVar("_Values", bound=Union[npt.NDArray[Any], np.generic])


def as_output(values: _Values, res: _engine.RowResults) -> Union[_Values, torch.Tensor]:
    """values as they go back to the user: a torch tensor on the logits'
    device when the logits are a tensor, else numpy as given."""
    if res.device is not None:
        import torch

        return torch.as_tensor(np.asarray(values), device=res.device)
    return values


def _per_position(values: F64Array, res: _engine.RowResults) -> Union[FloatArray, torch.Tensor]:
    """Per-row values shaped like the logits without their vocabulary axis:
    float64 for float64 logits, else float32."""
    with np.errstate(over="ignore"):  # beyond float32's range is inf, as the value is there
        typed: FloatArray = values if res.dtype == "float64" else values.astype(np.float32)
    return as_output(typed.reshape(res.lead_shape), res)


def _nll(logits: Any, targets: Any, ignore_index: Optional[int], shift: Optional[bool], softcap: Optional[float],
         num_threads: Optional[int]) -> _engine.RowResults:
    return _engine.run(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                       num_threads=num_threads, nll=True)


def _mean(total: float, count: int) -> float:
    return total / count if count else float("nan")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


class Deferred:
    """A metric launched on a CUDA device and not waited for (``sync=False``).

    The call queued the pass and returned: the host goes on while the
    device computes. ``float(d)`` (or ``d.item()``, or formatting it:
    ``f"{d:.4f}"``) waits for the pass once and gives exactly what the call
    with ``sync=True`` returns; a bad
    target or NaN row raises there, as that call raises it, and again at
    every later read. ``d.value`` is the value as a 0-d float64 tensor on
    the logits' device, computed there from the pass's per-row results
    with no wait (for a training loop that logs it later, or adds it up on
    the device); it is NaN where the call raises, and also where a row
    holds +inf logits (the host's exact path has that row: ``float(d)``;
    on the torch path, also a row whose NLL is not finite). It is summed
    by torch, so its last bits may differ from ``float(d)``; its first
    read orders it on the current stream (read on another stream than the
    call's, that stream waits for the pass). Until
    ``float(d)`` is read, ``d`` holds the logits (for that exact path):
    keep ``d.value`` to hold the value only.
    Logits the call computes on the host (numpy, CPU tensors, lazy
    logits) are done in the call, which raises their errors; ``d`` then
    holds the value (``d.value``: a 0-d tensor on their device, numpy's
    float64 for numpy logits).

    Examples
    --------
    >>> import torch, lmmetrics
    >>> logits = torch.zeros(4, 10)                     # uniform over 10 tokens
    >>> d = lmmetrics.perplexity(logits, torch.tensor([1, 2, 3, 4]), sync=False)
    >>> round(float(d), 6), d.value.dtype
    (10.0, torch.float64)
    """

    __slots__ = ("_res", "_host", "_device", "_value", "_error", "_there", "_lock")

    def __init__(self, res: _engine.RowResults, host: Callable[[float, int], float],
                 device: Callable[[Any, Any], Any]) -> None:
        self._res = res
        self._host = host      # (NLL sum, count) -> the value
        self._device = device  # the same over 0-d tensors
        self._value: Optional[float] = None
        self._error: Optional[BaseException] = None
        self._there: Optional[torch.Tensor] = None  # the value on the device, once asked
        # (threads reading at once: one completes the pass, filling its results, the others wait for its value)
        self._lock = threading.Lock()

    def result(self) -> float:
        """The value: waits for the device once; raises the call's error."""
        with self._lock:
            if self._error is not None:
                raise self._error.with_traceback(None)  # (this read's traceback, none kept)
            if self._value is None:
                try:
                    res = self._res.finish()
                except Exception as e:  # (kept, and the pass let go: its logits with it, and e's frames)
                    self._error, self._res.pending = _engine.let_go(e), None
                    raise self._error
                self._value = self._host(res.nll_sum, res.n_counted)
            return self._value

    __float__ = result
    item = result

    def __format__(self, spec: str) -> str:
        """The value formatted as a float (``f"{d:.4f}"``): a read, as
        ``float(d)``; with no format spec, ``str(d)`` (as every object)."""
        return format(self.result(), spec) if spec else str(self)

    @property
    def value(self) -> Union[torch.Tensor, np.float64]:
        """The value on the logits' device, a 0-d float64 tensor, with no
        wait (NaN where ``float()`` raises or takes a row of +inf logits
        through the exact path)."""
        if self._there is None:  # (queued once, on the first read)
            self._there = cast("Optional[torch.Tensor]", _engine.device_nll_total(self._res, self._device))
        if self._there is not None:
            return self._there
        if self._res.device is None:
            host: np.float64 = np.float64(self.result())
            return host
        import torch

        held: torch.Tensor = torch.tensor(self.result(), dtype=torch.float64, device=self._res.device)
        return held

    def __getstate__(self) -> Dict[str, Any]:
        """For copy and deepcopy: a copy has a lock of its own."""
        return {k: getattr(self, k) for k in self.__slots__ if k != "_lock"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if self._error is not None:
            return f"Deferred(error={self._error!r})"
        return "Deferred(pending)" if self._value is None and self._res.pending is not None else \
            f"Deferred({self.result()!r})"


def _check_sync(sync: object) -> bool:
    if sync is True or sync is False:
        return sync
    if not isinstance(sync, np.bool_):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    return bool(sync)


def _as_is(v: Any) -> Any:
    return v


def _deferred(logits: Any, targets: Any, reduction: str, options: Dict[str, Any],
              host: Callable[[float], float] = _as_is, device: Callable[[Any], Any] = _as_is) -> Deferred:
    """The NLL's mean or sum as a `Deferred` (a metric of it: host over
    the float, device over the 0-d tensor): the pass on a CUDA device
    launched and not waited for."""
    if reduction == "none":
        raise ValueError("sync=False gives a mean or a sum; reduction='none' returns per-token values (on the "
                         "logits' device already): call it with sync=True")
    res = _engine.run(logits, targets, nll=True, defer=True, **options)
    if reduction == "sum":
        return Deferred(res, lambda total, count: host(total), lambda total, count: device(total))
    return Deferred(res, lambda total, count: host(_mean(total, count)), lambda total, count: device(total / count))


# Per-position results follow the logits: a tensor for a tensor, numpy for
# numpy (or what np.asarray takes); a model output gives either.
@overload
def token_nll(logits: torch.Tensor, targets: Any, **options: Unpack[NllOptions]) -> torch.Tensor: ...
@overload
def token_nll(logits: NumpyLogits, targets: Any, **options: Unpack[NllOptions]) -> FloatArray: ...
@overload
def token_nll(logits: Any, targets: Any,
              **options: Unpack[NllOptions]) -> Union[FloatArray, torch.Tensor]: ...


def token_nll(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
              softcap: Optional[float] = None,
              num_threads: Optional[int] = None) -> Union[FloatArray, torch.Tensor]:
    """Negative log-likelihood of each target, in nats.

    ``nll = logsumexp(z) - z[y]`` per position, from one read of each row.

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

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shaped like ``targets`` (like ``targets[..., 1:]`` with ``shift=True``),
        0.0 where the target is ignored. float32 for 16- and 32-bit logits,
        float64 for float64 logits; a tensor on the logits' device (not
        requiring grad) when the logits are a tensor. Each value is computed
        in float64 (within 2e-6 of a float64 reference for float32 logits)
        and then rounded to float32, which adds up to ``6e-8 * value``: more
        than 2e-6 above 33 nats. The sums (`cross_entropy`, `evaluate`)
        add the float64 values and carry no such rounding.

    Raises
    ------
    ValueError
        A counted target >= V, targets whose shape does not match the logits',
        NaN in the logits of a counted position, a counted row that is all
        -inf, or an option out of range.
    TypeError
        Integer logits or float targets.

    See Also
    --------
    cross_entropy : the mean (or sum) of these values.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], np.float32))
    >>> lmmetrics.token_nll(logits, np.array([0, 2])).round(6)   # the last float32 bit depends on the SIMD path
    array([0.693147, 0.223144], dtype=float32)
    >>> lmmetrics.token_nll(logits, np.array([0, -100])).round(6)    # -100 is ignored
    array([0.693147, 0.      ], dtype=float32)
    """
    res = _nll(logits, targets, ignore_index, shift, softcap, num_threads)
    return _per_position(res.floats("nll"), res)


@overload
def cross_entropy(logits: Any, targets: Any, *, reduction: Literal["mean", "sum"] = ...,
                  sync: Literal[True] = ..., **options: Unpack[NllOptions]) -> float: ...
@overload
def cross_entropy(logits: Any, targets: Any, *, reduction: Literal["mean", "sum"] = ...,
                  sync: Literal[False], **options: Unpack[NllOptions]) -> Deferred: ...
@overload
def cross_entropy(logits: Any, targets: Any, *, reduction: Literal["mean", "sum"] = ...,
                  sync: bool, **options: Unpack[NllOptions]) -> Union[float, Deferred]: ...
@overload
def cross_entropy(logits: torch.Tensor, targets: Any, *, reduction: Literal["none"],
                  sync: Literal[True] = ..., **options: Unpack[NllOptions]) -> torch.Tensor: ...
@overload
def cross_entropy(logits: NumpyLogits, targets: Any, *, reduction: Literal["none"],
                  sync: Literal[True] = ..., **options: Unpack[NllOptions]) -> FloatArray: ...
@overload
def cross_entropy(logits: Any, targets: Any, *, reduction: str, sync: bool = ...,
                  **options: Unpack[NllOptions]) -> Union[float, FloatArray, torch.Tensor, Deferred]: ...


def cross_entropy(logits: Any, targets: Any, *, reduction: str = "mean", ignore_index: Optional[int] = -100,
                  shift: Optional[bool] = None, softcap: Optional[float] = None,
                  num_threads: Optional[int] = None, sync: bool = True) -> Union[float, FloatArray, torch.Tensor, Deferred]:
    """Cross-entropy in nats, as ``torch.nn.functional.cross_entropy``.

    With ``shift=True`` it is the ``loss`` of a transformers causal LM given
    ``labels``. Sums are taken in float64 over per-row float64 values in row
    order, so they do not depend on the thread count.

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
    reduction : {"mean", "sum", "none"}, default "mean"
        ``"mean"`` averages over counted tokens (nan when none is counted),
        ``"sum"`` adds them, ``"none"`` returns `token_nll`.
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
    sync : bool, default True
        ``False``: launch the pass on a CUDA device and return a `Deferred`
        at once, without waiting for the device (``float()`` of it waits and
        raises the call's errors; its ``value`` is a 0-d tensor on the
        device). The mean or sum only.

    Returns
    -------
    float or numpy.ndarray or torch.Tensor or Deferred
        A Python float for ``"mean"`` and ``"sum"`` (a `Deferred` with
        ``sync=False``); per-position values for ``"none"``.

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
    >>> logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], np.float32))
    >>> round(lmmetrics.cross_entropy(logits, np.array([0, 2])), 6)
    0.458145
    >>> round(lmmetrics.cross_entropy(logits, np.array([0, 2]), reduction="sum"), 6)
    0.916291
    """
    _check_reduction(reduction)
    if not _check_sync(sync):
        return _deferred(logits, targets, reduction, dict(ignore_index=ignore_index, shift=shift, softcap=softcap,
                                                          num_threads=num_threads))
    if reduction != "none":
        plain = _engine.nll_total(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                                  num_threads=num_threads)
        if plain is not None:
            return plain[0] if reduction == "sum" else _mean(*plain)
    res = _nll(logits, targets, ignore_index, shift, softcap, num_threads)
    if reduction == "none":
        return _per_position(res.floats("nll"), res)
    if reduction == "sum":
        return res.nll_sum
    return _mean(res.nll_sum, res.n_counted)


@overload
def perplexity(logits: Any, targets: Any, *, sync: Literal[True] = ..., **options: Unpack[NllOptions]) -> float: ...
@overload
def perplexity(logits: Any, targets: Any, *, sync: Literal[False], **options: Unpack[NllOptions]) -> Deferred: ...
@overload
def perplexity(logits: Any, targets: Any, *, sync: bool, **options: Unpack[NllOptions]) -> Union[float, Deferred]: ...


def perplexity(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
               softcap: Optional[float] = None, num_threads: Optional[int] = None,
               sync: bool = True) -> Union[float, Deferred]:
    """Perplexity: ``exp`` of the mean NLL over counted tokens.

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
    sync : bool, default True
        ``False``: launch the pass on a CUDA device and return a `Deferred`
        at once, without waiting for the device (``float()`` of it waits and
        raises the call's errors; its ``value`` is a 0-d tensor on the
        device).

    Returns
    -------
    float or Deferred
        ``exp(cross_entropy(...))``; nan when no token is counted, inf when
        the mean NLL passes ~709.78 nats. A `Deferred` with ``sync=False``.

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
    >>> logits = np.zeros((4, 10), np.float32)       # uniform over 10 tokens
    >>> round(lmmetrics.perplexity(logits, np.array([1, 2, 3, 4])), 6)
    10.0
    """
    if not _check_sync(sync):
        return _deferred(logits, targets, "mean", dict(ignore_index=ignore_index, shift=shift, softcap=softcap,
                                                       num_threads=num_threads), exp, lambda v: v.exp())
    return exp(cross_entropy(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                             num_threads=num_threads))


@overload
def bits_per_token(logits: Any, targets: Any, *, sync: Literal[True] = ..., **options: Unpack[NllOptions]) -> float: ...
@overload
def bits_per_token(logits: Any, targets: Any, *, sync: Literal[False], **options: Unpack[NllOptions]) -> Deferred: ...
@overload
def bits_per_token(logits: Any, targets: Any, *, sync: bool, **options: Unpack[NllOptions]) -> Union[float, Deferred]: ...


def bits_per_token(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
                   softcap: Optional[float] = None, num_threads: Optional[int] = None,
                   sync: bool = True) -> Union[float, Deferred]:
    """Mean NLL in bits: cross-entropy / ln 2.

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
    sync : bool, default True
        ``False``: launch the pass on a CUDA device and return a `Deferred`
        at once, without waiting for the device (``float()`` of it waits and
        raises the call's errors; its ``value`` is a 0-d tensor on the
        device).

    Returns
    -------
    float or Deferred
        Bits per counted token; nan when no token is counted. A `Deferred`
        with ``sync=False``.

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
    >>> logits = np.zeros((4, 16), np.float32)       # uniform over 16 tokens
    >>> round(lmmetrics.bits_per_token(logits, np.array([1, 2, 3, 4])), 6)
    4.0
    """
    if not _check_sync(sync):
        return _deferred(logits, targets, "mean", dict(ignore_index=ignore_index, shift=shift, softcap=softcap,
                                                       num_threads=num_threads), _in_bits, _in_bits)
    return cross_entropy(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                         num_threads=num_threads) / LN2


def _in_bits(nats: Any) -> Any:
    return nats / LN2


@overload
def loglikelihood(logits: torch.Tensor, targets: Any,
                  **options: Unpack[NllOptions]) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def loglikelihood(logits: NumpyLogits, targets: Any, **options: Unpack[NllOptions]) -> Tuple[
        Union[F64Array, np.float64], Union[BoolArray, np.bool_]]: ...
@overload
def loglikelihood(logits: Any, targets: Any, **options: Unpack[NllOptions]) -> Tuple[
        Union[F64Array, np.float64, torch.Tensor], Union[BoolArray, np.bool_, torch.Tensor]]: ...


def loglikelihood(logits: Any, targets: Any, *, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
                  softcap: Optional[float] = None, num_threads: Optional[int] = None) -> Tuple[
        Union[F64Array, np.float64, torch.Tensor], Union[BoolArray, np.bool_, torch.Tensor]]:
    """Per sequence, the log-probability of its counted targets and whether
    each of them is the argmax: lm-evaluation-harness's ``loglikelihood``
    (multiple-choice tasks: HellaSwag, ARC, MMLU, ...).

    Sequences run along the second-to-last axis. Mark the context (and
    padding) with ``ignore_index`` so that only the continuation counts. One
    read of the logits.

    Parameters
    ----------
    logits : array_like, torch.Tensor or model output
        Logits shaped (..., T, V) (at least a time axis), in any float dtype
        lmmetrics reads, or an object with ``.logits``.
    targets : array_like or torch.Tensor
        Integer token ids shaped (..., T) (unshifted labels with
        ``shift=True``); the counted ones are the continuation.
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

    Returns
    -------
    logprob : numpy.ndarray, numpy.float64 or torch.Tensor
        ``sum log p(target)`` over the counted positions of each sequence,
        float64, shaped like the leading axes (..., ): (B,) for (B, T, V)
        logits, a scalar for (T, V). 0.0 for a sequence with no counted
        target.
    is_greedy : numpy.ndarray, numpy.bool_ or torch.Tensor
        True where every counted target is the argmax of its row (the lowest
        index wins ties, as ``argmax``); True for a sequence with no counted
        target.

        numpy for numpy input; tensors on the logits' device for tensor input.

    Raises
    ------
    ValueError
        Logits without a time axis, or as for `token_nll`.
    TypeError
        Integer logits or float targets.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]], np.float32))   # (1, 2, 3)
    >>> logprob, is_greedy = lmmetrics.loglikelihood(logits, np.array([[-100, 2]]))       # context, continuation
    >>> print(np.round(logprob, 6), is_greedy)
    [-0.223144] [ True]
    """
    res = _engine.run(logits, targets, ignore_index=ignore_index, shift=shift, softcap=softcap,
                      num_threads=num_threads, nll=True, argmax=True)
    if not res.lead_shape:
        raise ValueError("loglikelihood needs logits with a time axis (..., T, V)")
    greedy = ~res.counted | (res.indices("argmax") == res.target_ids)
    logprob: Union[F64Array, np.float64] = 0.0 - res.floats("nll").reshape(res.lead_shape).sum(axis=-1)
    all_greedy: Union[BoolArray, np.bool_] = greedy.reshape(res.lead_shape).all(axis=-1)
    return as_output(logprob, res), as_output(all_greedy, res)


def units_of(res: _engine.RowResults, table: I64Array) -> I64Array:
    """table[target] per row (bytes or characters), 0 where not counted."""
    counted = res.counted
    units: I64Array = np.where(counted, table[np.where(counted, res.target_ids, 0)], 0)
    return units


def unit_sums(res: _engine.RowResults, table: I64Array) -> Tuple[int, float]:
    """(sum table[target], sum NLL of the tokens whose entry is > 0) over
    counted tokens: bytes (or characters) and the NLL that goes with them."""
    units = units_of(res, table)
    return int(units.sum()), float(np.sum(res.floats("nll")[units > 0]))


def _per_unit(res: _engine.RowResults, table: I64Array, skip_zero: bool) -> float:
    """sum NLL / (ln 2 * sum table[target]) over counted tokens; with
    skip_zero, tokens whose table entry is 0 leave both sums."""
    total_units, nll_with_units = unit_sums(res, table)
    return bits_per_unit(nll_with_units if skip_zero else res.nll_sum, total_units)


def bits_per_byte(logits: Any, targets: Any, token_bytes: Any, *, ignore_index: Optional[int] = -100,
                  shift: Optional[bool] = None, softcap: Optional[float] = None,
                  num_threads: Optional[int] = None) -> float:
    """Bits per byte, with nanochat's semantics.

    ``sum NLL / (ln 2 * sum bytes)`` over counted positions, where
    ``bytes = token_bytes[target]``; positions whose target has 0 bytes
    (special tokens) leave both sums.

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
    token_bytes : array_like or torch.Tensor
        ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for
        special tokens; one entry per column of the logits (V).
        `lmmetrics.token_bytes` builds it from a tokenizer.
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

    Returns
    -------
    float
        Bits per byte; ``inf`` when no byte was counted.

    Raises
    ------
    ValueError
        A counted target >= V, targets whose shape does not match the logits',
        NaN in the logits of a counted position, a counted row that is all
        -inf, or an option out of range, or a ``token_bytes`` that is not a 1-D table of V
        non-negative counts.
    TypeError
        Integer logits or float targets.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.zeros((3, 4), np.float32)           # uniform: 2 bits per token
    >>> token_bytes = np.array([1, 2, 4, 0])            # token 3 is special
    >>> round(lmmetrics.bits_per_byte(logits, np.array([1, 2, 3]), token_bytes), 6)   # 4 bits / 6 bytes
    0.666667
    """
    res = _nll(logits, targets, ignore_index, shift, softcap, num_threads)
    return _per_unit(res, as_table(token_bytes, res.n_cols, "token_bytes"), skip_zero=True)


def bits_per_character(logits: Any, targets: Any, *, token_chars: Any = None,
                       ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
                       softcap: Optional[float] = None, num_threads: Optional[int] = None) -> float:
    """Bits per character.

    Without ``token_chars`` the model is character-level and this equals
    `bits_per_token`. With ``token_chars[v]``, the number of characters
    of token ``v``, it is ``sum NLL / (ln 2 * sum chars)`` over counted
    tokens (``N / T * ln(PPL) / ln 2`` for N tokens spelling T characters).

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
    token_chars : array_like, torch.Tensor or None, default None
        Characters per token, one entry per column of the logits (V).
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

    Returns
    -------
    float
        Bits per character; ``inf`` when no character was counted (with
        ``token_chars``), nan when no token was counted (without).

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
    >>> logits = np.zeros((2, 4), np.float32)           # uniform: 2 bits per token
    >>> round(lmmetrics.bits_per_character(logits, np.array([0, 1]), token_chars=np.array([2, 2, 1, 1])), 6)
    1.0
    """
    res = _nll(logits, targets, ignore_index, shift, softcap, num_threads)
    if token_chars is None:
        return _mean(res.nll_sum, res.n_counted) / LN2
    return _per_unit(res, as_table(token_chars, res.n_cols, "token_chars"), skip_zero=False)


@overload
def token_entropy(logits: torch.Tensor, **options: Unpack[RowOptions]) -> torch.Tensor: ...
@overload
def token_entropy(logits: NumpyLogits, **options: Unpack[RowOptions]) -> FloatArray: ...
@overload
def token_entropy(logits: Any, **options: Unpack[RowOptions]) -> Union[FloatArray, torch.Tensor]: ...


def token_entropy(logits: Any, *, softcap: Optional[float] = None,
                  num_threads: Optional[int] = None) -> Union[FloatArray, torch.Tensor]:
    """Predictive entropy ``-sum p log p`` of each row, in nats.

    ``p = softmax(logits)``; entries of probability 0 (from -inf logits) add
    nothing.

    Parameters
    ----------
    logits : array_like, torch.Tensor or model output
        Logits shaped (..., V), the vocabulary last: a numpy array or a torch
        tensor (CPU, read in place; CUDA, computed on its device) in float32,
        float64, float16 or bfloat16, or an object with ``.logits`` (a
        Hugging Face model output).
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shaped like the logits without their vocabulary axis; float32 (float64
        for float64 logits: each value rounded from float64, as
        `token_nll`'s), a tensor on the logits' device for a tensor.

    Raises
    ------
    ValueError
        NaN in the logits, a row that is all -inf, different shapes, or an
        option out of range.
    TypeError
        Integer logits.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> logits = np.array([[0.0, 0.0, -np.inf, -np.inf], [0.0, 0.0, 0.0, 0.0]], np.float32)
    >>> lmmetrics.token_entropy(logits)     # ln 2, ln 4
    array([0.6931472, 1.3862944], dtype=float32)
    """
    res = _engine.run(logits, softcap=softcap, num_threads=num_threads, entropy=True)
    return _per_position(res.floats("entropy"), res)


@overload
def token_kl(logits: torch.Tensor, *, reference_logits: Any,
             **options: Unpack[RowOptions]) -> torch.Tensor: ...
@overload
def token_kl(logits: NumpyLogits, *, reference_logits: Any, **options: Unpack[RowOptions]) -> FloatArray: ...
@overload
def token_kl(logits: Any, *, reference_logits: Any,
             **options: Unpack[RowOptions]) -> Union[FloatArray, torch.Tensor]: ...


def token_kl(logits: Any, *, reference_logits: Any, softcap: Optional[float] = None,
             num_threads: Optional[int] = None) -> Union[FloatArray, torch.Tensor]:
    """``KL(softmax(reference_logits) || softmax(logits))`` of each row, in nats.

    The reference is the distribution the expectation is taken over: the base
    model when judging a quantized one.

    Parameters
    ----------
    logits : array_like, torch.Tensor or model output
        Logits shaped (..., V), the vocabulary last: a numpy array or a torch
        tensor (CPU, read in place; CUDA, computed on its device) in float32,
        float64, float16 or bfloat16, or an object with ``.logits`` (a
        Hugging Face model output).
    reference_logits : array_like, torch.Tensor or model output
        The reference model's logits (keyword-only, so that two buffers of the
        same shape cannot be swapped): the distribution P_ref the expectation
        is taken over. Same shape as ``logits``; the dtype may differ (a
        float32 base against bfloat16 or float16 logits), each read in its
        own dtype.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.

    Returns
    -------
    numpy.ndarray or torch.Tensor
        Shaped like the logits without their vocabulary axis; ``inf`` where the
        reference gives mass to an entry the model rules out (-inf). float32
        (float64 for float64 model logits), each value rounded from float64
        as `token_nll`'s.

    Raises
    ------
    ValueError
        NaN in the logits, a row that is all -inf, different shapes, or an
        option out of range.
    TypeError
        Integer logits.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> ref = np.log(np.array([[0.5, 0.5]], np.float32))
    >>> model = np.log(np.array([[0.25, 0.75]], np.float32))
    >>> np.round(lmmetrics.token_kl(model, reference_logits=ref), 6)    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    array([0.143841], dtype=float32)
    """
    res = _engine.run(logits, reference=reference_logits, softcap=softcap, num_threads=num_threads,
                      kl=True)
    return _per_position(res.floats("kl"), res)


@overload
def kl_divergence(logits: Any, *, reference_logits: Any, reduction: Literal["mean", "sum"] = ...,
                  **options: Unpack[RowOptions]) -> float: ...
@overload
def kl_divergence(logits: torch.Tensor, *, reference_logits: Any, reduction: Literal["none"],
                  **options: Unpack[RowOptions]) -> torch.Tensor: ...
@overload
def kl_divergence(logits: NumpyLogits, *, reference_logits: Any, reduction: Literal["none"],
                  **options: Unpack[RowOptions]) -> FloatArray: ...
@overload
def kl_divergence(logits: Any, *, reference_logits: Any, reduction: str,
                  **options: Unpack[RowOptions]) -> Union[float, FloatArray, torch.Tensor]: ...


def kl_divergence(logits: Any, *, reference_logits: Any, reduction: str = "mean",
                  softcap: Optional[float] = None,
                  num_threads: Optional[int] = None) -> Union[float, FloatArray, torch.Tensor]:
    """KL(P_ref || P_model) over rows, in nats.

    Parameters
    ----------
    logits : array_like, torch.Tensor or model output
        Logits shaped (..., V), the vocabulary last: a numpy array or a torch
        tensor (CPU, read in place; CUDA, computed on its device) in float32,
        float64, float16 or bfloat16, or an object with ``.logits`` (a
        Hugging Face model output).
    reference_logits : array_like, torch.Tensor or model output
        The reference model's logits (keyword-only, so that two buffers of the
        same shape cannot be swapped): the distribution P_ref the expectation
        is taken over. Same shape as ``logits``; the dtype may differ (a
        float32 base against bfloat16 or float16 logits), each read in its
        own dtype.
    reduction : {"mean", "sum", "none"}, default "mean"
        ``"mean"`` per row, ``"sum"`` over rows (float64), ``"none"`` the
        per-row values of `token_kl`.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.

    Returns
    -------
    float or numpy.ndarray or torch.Tensor
        A Python float for ``"mean"`` and ``"sum"``.

    Raises
    ------
    ValueError
        NaN in the logits, a row that is all -inf, different shapes, or an
        option out of range.
    TypeError
        Integer logits.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> ref = np.log(np.array([[0.5, 0.5], [0.5, 0.5]], np.float32))
    >>> model = np.log(np.array([[0.25, 0.75], [0.5, 0.5]], np.float32))
    >>> round(lmmetrics.kl_divergence(model, reference_logits=ref), 6)
    0.071921
    """
    _check_reduction(reduction)
    res = _engine.run(logits, reference=reference_logits, softcap=softcap, num_threads=num_threads,
                      kl=True)
    kl = res.floats("kl")
    if reduction == "none":
        return _per_position(kl, res)
    with np.errstate(over="ignore"):  # (a sum past float64's range is inf)
        total = float(np.sum(kl))
    if reduction == "sum":
        return total
    # (finite values whose sum passes float64's range have a finite mean: it was inf)
    return finite_mean(_mean(total, kl.size), kl)
