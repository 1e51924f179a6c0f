"""torchmetrics ``Metric`` classes over lmmetrics' kernel, for Lightning and
other torchmetrics users: :class:`Perplexity`, :class:`BitsPerByte` and
:class:`LanguageModelMetrics` (every field of :class:`lmmetrics.Metrics`).

They are real ``torchmetrics.Metric`` subclasses: ``update`` adds a batch,
``compute`` gives the value over everything seen (synced across
``torch.distributed`` ranks by torchmetrics' own state reduction: float64
sums with ``dist_reduce_fx="sum"``), ``forward`` returns the batch's value
and accumulates it, ``reset`` starts over, ``.to(device)`` moves the states
(which stay float64 under ``.to(dtype)`` and ``.half()``).
Arguments shared with ``torchmetrics.text.Perplexity`` mean the same
(``ignore_index``, default None); negative targets are always ignored, and
``shift=True`` takes unshifted Hugging Face labels. Each update reads the
logits once (CPU tensors in place, CUDA tensors on their device) and lets no
gradient flow: these are metrics, not a loss.

Needs torchmetrics; ``import lmmetrics`` alone does not import this module
(nor torch).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch.nn import Module
from torchmetrics import Metric

from .evaluation import Evaluator, Metrics, state_from_floats

__all__ = ["LanguageModelMetrics", "Perplexity", "BitsPerByte"]


class _EvaluatorMetric(Metric):
    """A torchmetrics Metric over an :class:`lmmetrics.Evaluator`: its sums
    are the float64 states; subclasses say what ``compute`` reports."""

    is_differentiable = False
    higher_is_better: Optional[bool] = None
    full_state_update = False
    _nll_only = False  # True: the NLL alone (no entropy or accuracy)

    def __init__(self, ignore_index: Optional[int] = None, *, token_bytes: Any = None, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self._evaluator = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift,
                                    softcap=softcap, num_threads=num_threads, nll_only=self._nll_only)
        for k in self._evaluator.state_dict():
            self.add_state(k, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def _apply(self, fn: Callable[..., Any], exclude_state: Any = "") -> Module:
        """Move the states with the metric (``.to(device)``, ``.cuda()``) but
        keep them, and the cached results, float64 under ``.to(dtype)``: the
        sums and the values must not round."""
        cached = self._computed, self._forward_cache
        this = super()._apply(fn, exclude_state=list(self._defaults))
        assert isinstance(this, _EvaluatorMetric)  # Module._apply returns self

        def move(x: Any) -> Any:  # a tensor, a dict of them (compute's results), None
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x.to(this.device) if isinstance(x, torch.Tensor) else x

        for k, v in this._defaults.items():
            this._defaults[k] = move(v)
            setattr(this, k, move(getattr(this, k)))
        this._computed, this._forward_cache = (move(c) for c in cached)
        return this

    def update(self, preds: Any, target: Any, *, reference_logits: Any = None) -> None:
        """Add a batch.

        Parameters
        ----------
        preds : torch.Tensor or model output
            Logits (..., V), or an object with ``.logits``.
        target : torch.Tensor
            Integer targets (...) (unshifted labels with ``shift=True``).
        reference_logits : torch.Tensor, optional
            A reference model's logits of the same shape (keyword-only), for
            ``kl`` and ``same_top``.
        """
        ev = self._evaluator
        ev.reset()
        ev.update(preds, target, reference_logits=reference_logits)
        for k, v in ev.state_dict().items():
            setattr(self, k, getattr(self, k) + v)

    def _synced(self) -> Evaluator:
        """The Evaluator holding the current (synced) states."""
        ev = self._evaluator
        ev.load_state_dict(state_from_floats({k: float(getattr(self, k)) for k in ev.state_dict()}))
        return ev

    def _metrics(self) -> Metrics:
        """The lmmetrics Metrics of the current (synced) states."""
        return self._synced().compute()

    def _value(self, v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float64, device=self.device)


class LanguageModelMetrics(_EvaluatorMetric):
    """Every metric of :func:`lmmetrics.evaluate`, streamed, as a torchmetrics ``Metric``.

    ``compute()`` returns a dict of float64 tensors (``loss``, ``perplexity``,
    ``bits_per_token``, ``accuracy``, ``entropy``, the counts, and
    ``bits_per_byte`` with ``token_bytes``, ``kl`` and ``same_top`` after
    updates given ``reference_logits``). The states are float64 sums with
    ``dist_reduce_fx="sum"`` (torchmetrics syncs them across ranks) and stay
    float64 under ``.to(dtype)``. No gradient flows.

    Parameters
    ----------
    ignore_index : int or None, default None
        As for ``torchmetrics.text.Perplexity``: targets equal to it are not
        counted; negative targets are never counted.
    token_bytes : array_like or torch.Tensor, optional
        ``token_bytes[v]``, the UTF-8 byte length of token ``v`` (0 for
        special tokens), for ``bytes`` and ``bits_per_byte``.
    shift : bool, default False
        ``True`` for unshifted labels as Hugging Face passes them: position t
        of the logits is scored against ``targets[..., t + 1]`` and each
        sequence's last position is dropped (a view, no copy).
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.
    **kwargs
        Passed to ``torchmetrics.Metric`` (``sync_on_compute``,
        ``dist_sync_on_step``, ...).

    Examples
    --------
    >>> import torch
    >>> from lmmetrics.torchmetrics import LanguageModelMetrics
    >>> metric = LanguageModelMetrics(token_bytes=torch.full((10,), 2))
    >>> metric.update(torch.zeros(2, 5, 10), torch.randint(0, 10, (2, 5)))   # uniform over 10 tokens
    >>> out = metric.compute()
    >>> int(out["tokens"]), round(float(out["perplexity"]), 4)
    (10, 10.0)
    """

    def compute(self) -> Dict[str, torch.Tensor]:
        """Every metric over the batches seen (synced across ranks).

        Returns
        -------
        dict of str to torch.Tensor
            float64 scalars, one per field of :class:`lmmetrics.Metrics` that has
            a value.
        """
        return {k: self._value(v) for k, v in self._metrics().as_dict().items() if v is not None}


class Perplexity(_EvaluatorMetric):
    """Perplexity, as ``torchmetrics.text.Perplexity``, from one read of the
    logits and float64 sums.

    ``exp(mean NLL)`` over the counted targets; preds are (..., V) logits,
    target (...).

    Parameters
    ----------
    ignore_index : int or None, default None
        As for ``torchmetrics.text.Perplexity``: targets equal to it are not
        counted; negative targets are never counted.
    shift : bool, default False
        ``True`` for unshifted labels as Hugging Face passes them: position t
        of the logits is scored against ``targets[..., t + 1]`` and each
        sequence's last position is dropped (a view, no copy).
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.
    **kwargs
        Passed to ``torchmetrics.Metric`` (``sync_on_compute``,
        ``dist_sync_on_step``, ...).

    Examples
    --------
    >>> import torch
    >>> from lmmetrics.torchmetrics import Perplexity
    >>> ppl = Perplexity(shift=True)                     # Hugging Face labels
    >>> ppl.update(torch.zeros(2, 6, 10), torch.randint(0, 10, (2, 6)))
    >>> round(float(ppl.compute()), 4)                   # uniform over 10 tokens
    10.0
    """

    higher_is_better = False
    _nll_only = True

    def __init__(self, ignore_index: Optional[int] = None, *, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        super().__init__(ignore_index, shift=shift, softcap=softcap, num_threads=num_threads, **kwargs)

    def compute(self) -> torch.Tensor:
        """The perplexity over the batches seen (synced across ranks).

        Returns
        -------
        torch.Tensor
            A float64 scalar; nan before any counted target.
        """
        return self._value(self._metrics().perplexity)


class BitsPerByte(_EvaluatorMetric):
    """Bits per byte with nanochat's semantics (:func:`lmmetrics.bits_per_byte`),
    as a torchmetrics ``Metric``.

    Tokens whose ``token_bytes`` entry is 0 (special tokens) leave both sums.

    Parameters
    ----------
    token_bytes : array_like or torch.Tensor
        ``token_bytes[v]``, the UTF-8 byte length of token ``v``.
    ignore_index : int or None, default None
        As for ``torchmetrics.text.Perplexity``: targets equal to it are not
        counted; negative targets are never counted.
    shift : bool, default False
        ``True`` for unshifted labels as Hugging Face passes them: position t
        of the logits is scored against ``targets[..., t + 1]`` and each
        sequence's last position is dropped (a view, no copy).
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.
    **kwargs
        Passed to ``torchmetrics.Metric`` (``sync_on_compute``,
        ``dist_sync_on_step``, ...).

    Examples
    --------
    >>> import torch
    >>> from lmmetrics.torchmetrics import BitsPerByte
    >>> bpb = BitsPerByte(torch.full((16,), 2))
    >>> bpb.update(torch.zeros(3, 16), torch.tensor([1, 2, 3]))   # 4 bits a token, 2 bytes a token
    >>> round(float(bpb.compute()), 4)
    2.0
    """

    higher_is_better = False
    _nll_only = True

    def __init__(self, token_bytes: Any, ignore_index: Optional[int] = None, *, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        super().__init__(ignore_index, token_bytes=token_bytes, shift=shift, softcap=softcap,
                         num_threads=num_threads, **kwargs)

    def compute(self) -> torch.Tensor:
        """The bits per byte over the batches seen (synced across ranks).

        Returns
        -------
        torch.Tensor
            A float64 scalar; inf before any counted byte.
        """
        return self._value(self._synced().bits_per_byte())
