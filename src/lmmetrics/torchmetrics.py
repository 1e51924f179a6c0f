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

from typing import Any, Dict, Optional

import torch
from torchmetrics import Metric

from .evaluation import Evaluator, Metrics, state_from_floats

__all__ = ["LanguageModelMetrics", "Perplexity", "BitsPerByte"]


class LanguageModelMetrics(Metric):
    """Every metric of :func:`lmmetrics.evaluate`, streamed: ``compute()``
    returns a dict of float64 tensors (``loss``, ``perplexity``,
    ``bits_per_token``, ``accuracy``, ``entropy``, the counts, and
    ``bits_per_byte`` with ``token_bytes``, ``kl`` and ``same_top`` after
    updates given ``reference_logits``), ready for ``self.log_dict``.

    ``update(preds, target, *, reference_logits=None)``: logits (..., V) or
    a model output with ``.logits``, targets (...), the reference keyword-only.
    """

    is_differentiable = False
    higher_is_better: Optional[bool] = None
    full_state_update = False
    _full = True  # entropy and accuracy as well as the NLL

    def __init__(self, ignore_index: Optional[int] = None, *, token_bytes: Any = None, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self._evaluator = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift,
                                    softcap=softcap, num_threads=num_threads)
        self._evaluator._full = self._full
        for k in self._evaluator.state_dict():
            self.add_state(k, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def _apply(self, fn: Any, exclude_state: Any = "") -> "LanguageModelMetrics":
        """Move the states with the metric (``.to(device)``, ``.cuda()``) but
        keep them float64 under ``.to(dtype)``: the sums must not round."""
        this = super()._apply(fn, exclude_state=list(self._defaults))
        for k, v in this._defaults.items():
            this._defaults[k] = v.to(this.device)
            setattr(this, k, getattr(this, k).to(this.device))
        return this

    def update(self, preds: Any, target: Any, *, reference_logits: Any = None) -> None:
        """Add a batch (one read of its logits)."""
        ev = self._evaluator
        ev.reset()
        ev.update(preds, target, reference_logits=reference_logits)
        for k, v in ev.state_dict().items():
            setattr(self, k, getattr(self, k) + v)

    def _metrics(self) -> Metrics:
        """The lmmetrics Metrics of the current (synced) states."""
        ev = self._evaluator
        ev.load_state_dict(state_from_floats({k: float(getattr(self, k)) for k in ev.state_dict()}))
        return ev.compute()

    def _value(self, v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float64, device=self.device)

    def compute(self) -> Dict[str, torch.Tensor]:
        return {k: self._value(v) for k, v in self._metrics().as_dict().items() if v is not None}


class Perplexity(LanguageModelMetrics):
    """exp(mean NLL) over the counted targets, as ``torchmetrics.text.Perplexity``
    (preds (..., V) logits, target (...)), from one read of the logits and
    float64 sums; a float64 tensor, nan before any counted target."""

    higher_is_better = False
    _full = False

    def __init__(self, ignore_index: Optional[int] = None, *, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(ignore_index, shift=shift, softcap=softcap, num_threads=num_threads, **kwargs)

    def compute(self) -> torch.Tensor:
        return self._value(self._metrics().perplexity)


class BitsPerByte(LanguageModelMetrics):
    """Bits per byte with nanochat's semantics (:func:`lmmetrics.bits_per_byte`):
    ``token_bytes[v]`` is the UTF-8 length of token v, 0 for special tokens,
    which leave both sums; a float64 tensor, inf before any counted byte."""

    higher_is_better = False
    _full = False

    def __init__(self, token_bytes: Any, ignore_index: Optional[int] = None, *, shift: bool = False,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(ignore_index, token_bytes=token_bytes, shift=shift, softcap=softcap,
                         num_threads=num_threads, **kwargs)

    def compute(self) -> torch.Tensor:
        return self._value(self._metrics().bits_per_byte)
