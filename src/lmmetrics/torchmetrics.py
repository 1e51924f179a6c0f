"""torchmetrics ``Metric`` classes over lmmetrics' kernel, for Lightning and
other torchmetrics users: `Perplexity`, `BitsPerByte` and
`LanguageModelMetrics` (every field of `lmmetrics.Metrics`).

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
gradient flow: these are metrics, not a loss. Several threads may use one
metric: each call holds its lock, so every batch is added once and a read
sees whole batches.

Needs torchmetrics; ``import lmmetrics`` alone does not import this module
(nor torch).
"""
from __future__ import annotations

import copy
import functools
import math
import threading
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Dict, ItemsView, Iterator, KeysView, Optional, Sequence, Tuple, ValuesView, cast

import torch
from torch.nn import Module, ModuleDict
from torchmetrics import Metric

from .evaluation import (Evaluator, Metrics, _differing, _digest, _one_at_a_time, _raise_where_failed, both_held,
                         state_from_floats)

# what can be logged: the keys of Metrics.as_dict() without document_ids
_BASE = tuple(f.name for f in dataclass_fields(Metrics))[:12]  # tokens .. same_top
_WITH_STDERR = ("loss", "bits_per_token", "bits_per_byte", "accuracy", "entropy", "kl", "same_top", "loss_diff")
_FIELDS = _BASE + ("loss_ref", "loss_diff", "perplexity_low", "perplexity_high") + tuple(
    f + "_stderr" for f in _WITH_STDERR)
_WITH_TOKEN_BYTES = ("bytes", "bits_per_byte", "bits_per_byte_stderr")
_WITH_REFERENCE = ("kl", "same_top", "loss_ref", "loss_diff", "kl_stderr", "same_top_stderr", "loss_diff_stderr")

__all__ = ["LanguageModelMetrics", "Perplexity", "BitsPerByte"]


class _EvaluatorMetric(Metric):
    """A torchmetrics Metric over an `lmmetrics.Evaluator`: its sums
    are the float64 states; subclasses say what ``compute`` reports."""

    is_differentiable = False
    higher_is_better: Optional[bool] = None
    full_state_update = False
    _nll_only = False  # True: the NLL alone (no entropy or accuracy)

    def __init__(self, ignore_index: Optional[int] = None, *, token_bytes: Any = None, shift: Optional[bool] = None,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self._held: Dict[str, Any] = {}  # the states' values (`_state`)
        self._evaluator = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift,
                                    softcap=softcap, num_threads=num_threads, nll_only=self._nll_only)
        for k in self._evaluator._state_now():
            self.add_state(k, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        # what the sums mean (the class, its settings): a MetricCollection groups metrics whose states are
        # equal after the first update, which states still all 0 (no counted target) would be across classes
        said = {k: v[0] for k, v in self._evaluator._settings().items() if k != "document_ids"}
        meaning = _digest(repr((type(self).__name__, sorted(said.items()), shift)).encode()) % 2**52
        self.add_state("settings", default=torch.tensor(float(meaning), dtype=torch.float64), dist_reduce_fx="max")

    # Several threads may use one metric (update, forward, compute, reset,
    # state_dict, merge_state, pickling): each call runs while it holds
    # the Evaluator's lock, so that a batch is added once and a read sees
    # whole batches, as torchmetrics' own metrics of tensor states give.
    @property
    def _lock(self) -> threading.RLock:  # (`_one_at_a_time`)
        return self._evaluator._lock

    def _wrap_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        """torchmetrics' update (its count of updates included), holding the lock."""
        return self._locked(super()._wrap_update(update))

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        """torchmetrics' compute (its cached value included), holding the lock."""
        return self._locked(super()._wrap_compute(compute))

    def _locked(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return method(*args, **kwargs)
        return locked

    @_one_at_a_time
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
            if k in this._held:  # (as held: a read would wait for a batch left to wait, each `self.log`)
                this._held[k] = move(this._held[k])
            else:
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
        ev.update(preds, target, reference_logits=reference_logits)
        # the batches added so far into the states; a batch on a CUDA device
        # waits for the next update or read (once only, at the first update:
        # a MetricCollection compares the states then, to group metrics)
        self._fold(settle=self._update_count <= 1)

    @_one_at_a_time
    def _fold(self, settle: bool = True) -> None:
        """Move the Evaluator's sums into the states; with settle, first add
        the batch not yet added (its pass on a device waited for) and raise
        the errors such passes found, once what was added is in the states."""
        ev = self._evaluator
        error: Optional[ValueError] = None
        if settle:
            try:
                ev._settle()
            except ValueError as e:
                error = e
        state = ev._state_now()
        ev._clear_sums()
        for k, v in state.items():  # (past `_state`'s read, which would wait for a batch left to wait)
            self._held[k] = self._held[k] + v
        if error is not None:
            raise error

    @_one_at_a_time
    def sync(self, dist_sync_fn: Optional[Callable[..., Any]] = None, process_group: Any = None,
             should_sync: bool = True, distributed_available: Optional[Callable[[], bool]] = None) -> None:
        """torchmetrics' sync of the states across ranks, once every batch is
        in them. A batch whose pass on a device failed raises on every rank
        that syncs, before anything travels (on its own rank alone it would
        leave the others waiting in the gather): that rank its own error,
        the others one naming it; the states keep the batches that
        succeeded. Likewise every rank raises, naming what differs, when
        the ranks' metrics are of other classes or settings (their sums
        mean other things: another ``token_bytes`` table summed bytes of
        other lengths)."""
        failed: Optional[ValueError] = None
        try:
            self._fold()
        except ValueError as e:
            failed = e
        if distributed_available is None:
            distributed_available = self.distributed_available_fn
        if should_sync and not self._is_synced and callable(distributed_available) and distributed_available():
            import torch.distributed as dist

            # each rank's failed update (0 or 1) and what its sums mean (the `settings` state's default)
            mine = torch.tensor([int(failed is not None), int(cast(torch.Tensor, self._defaults["settings"]).item())],
                                dtype=torch.int64, device=self.device)
            flags = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
            dist.all_gather(flags, mine, group=process_group)
            table = [f.cpu().tolist() for f in flags]  # the same on every rank: every rank takes the same branch
            _raise_where_failed(failed, [row[0] for row in table], process_group, type(self).__name__,
                               "synced (every rank raises; the states keep the batches that succeeded)")
            if len({row[1] for row in table}) > 1:
                said = {"class": type(self).__name__, "shift": repr(self._evaluator.shift),
                        **{k: text for k, (_, text) in self._evaluator._settings().items() if k != "document_ids"}}
                raise ValueError(f"{type(self).__name__}: the ranks' metrics differ, their sums cannot be synced: "
                                 f"{_differing(said, None, process_group)}. Make every rank's metric of the same "
                                 f"class and settings")
        if failed is not None:
            raise failed
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)

    @_one_at_a_time
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's value, accumulated (torchmetrics' forward), once the
        batches before it are in the states. A batch that fails (NaN logits)
        raises and leaves the metric as it was: torchmetrics' forward resets
        the states to score the batch alone, and would leave them reset,
        the batches before it lost."""
        self._fold()
        states = self._copy_state_dict()
        names = ("_update_count", "_computed", "_forward_cache", "_to_sync", "_should_unsync", "compute_on_cpu",
                 "_enable_grad")
        context: Dict[str, Any] = {k: self.__dict__[k] for k in names if k in self.__dict__}  # (this version's)
        try:
            return super().forward(*args, **kwargs)
        except BaseException:
            self._evaluator.reset()  # the failed batch's partial sums, if any
            for k, v in states.items():
                setattr(self, k, v)
            self.__dict__.update(context)
            raise

    def merge_state(self, incoming_state: Any) -> None:
        """torchmetrics' merge of another metric's states (or of their dict,
        ``metric_state``), once every batch is in both; ValueError for a
        metric of another class or settings (its sums mean another thing).
        A dict without ``settings`` (saved before it existed) is taken as
        this metric's. The next ``compute`` gives the merged value (torchmetrics
        keeps the value computed before the merge)."""
        theirs = incoming_state._lock if isinstance(incoming_state, _EvaluatorMetric) else self._lock
        with both_held(self._lock, theirs):
            self._merge_state(incoming_state)

    def _merge_state(self, incoming_state: Any) -> None:
        self._fold()
        if isinstance(incoming_state, _EvaluatorMetric):
            incoming_state._fold()
            theirs = incoming_state.__dict__.get("settings")
        elif isinstance(incoming_state, dict):
            if "settings" in self._defaults and "settings" not in incoming_state:
                incoming_state = {**incoming_state, "settings": self.settings}
            theirs = incoming_state.get("settings")
        else:
            theirs = None
        ours = self.__dict__.get("settings")
        if theirs is not None and ours is not None and float(theirs) != float(ours):
            raise ValueError(f"merge_state: the incoming metric is of another class or settings than this "
                             f"{type(self).__name__} (ignore_index, token_bytes, shift, softcap): its sums mean "
                             f"another thing")
        super().merge_state(incoming_state)
        self._computed = None  # (torchmetrics' cached compute: the value before the merge)

    @_one_at_a_time
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict, once every batch is in the states."""
        self._fold()
        return super().state_dict(*args, **kwargs)

    @_one_at_a_time
    def reset(self) -> None:
        """Start over (a batch not yet added included: dropped first, not
        waited for)."""
        self._evaluator.reset()
        super().reset()

    # Reading a state adds a batch left to wait (`_state`): what reads the
    # states without reading the metric takes them as held, with no wait.
    def __hash__(self) -> int:
        """The metric's identity (torchmetrics hashes the states' values too,
        which a module walk, ``model.train()`` or ``zero_grad()``, would
        then wait for; ``id`` alone makes a module's hash unique)."""
        return hash((type(self).__name__, id(self)))

    def _move_list_states_to_cpu(self) -> None:
        """Nothing (``compute_on_cpu``): the states are 0-d tensors, none a list."""

    @_one_at_a_time
    def __getstate__(self) -> Dict[str, Any]:
        """torchmetrics' pickling (and copying), a batch left to wait added
        to the states first (its error kept for the next read)."""
        self._evaluator._drain()
        self._fold(settle=False)
        state: Dict[str, Any] = super().__getstate__()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """torchmetrics' unpickling, the states held apart; a metric pickled
        with its states among its attributes is read too."""
        state = dict(state)
        held = state.pop("_held", None)
        if held is None:
            held = {k: state.pop(k) for k in _STATE_NAMES if k in state}
        state["_held"] = dict(held)
        super().__setstate__(state)

    def __copy__(self) -> _EvaluatorMetric:
        """A metric of its own, as ``clone()`` (a copy sharing the Evaluator
        would share its batch left to wait)."""
        return copy.deepcopy(self)

    @_one_at_a_time
    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """torchmetrics' loading of the states; a batch left to wait is
        dropped when they are loaded (it would be added on top of them), not
        when a state dict without them is (a model's weights). ValueError,
        nothing loaded, for the states of a metric of another class or
        settings (their ``settings``), as `merge_state` and
        `lmmetrics.Evaluator.load_state_dict` refuse them: a
        `Perplexity`'s sums hold no entropy nor accuracy, which a
        `LanguageModelMetrics` would report as 0. The next ``compute`` gives
        the loaded states' value (torchmetrics keeps the one computed
        before)."""
        made = state_dict.get(prefix + "settings")
        if made is not None and float(made) != float(cast(torch.Tensor, self._defaults["settings"])):
            raise ValueError(f"load_state_dict: the states under {prefix + 'settings'!r} are those of a metric of "
                             f"another class or settings than this {type(self).__name__} (ignore_index, "
                             f"token_bytes, shift, softcap): their sums mean another thing. Load them into a "
                             f"metric made as the one that saved them")
        if any(prefix + k in state_dict for k in self._defaults):
            self._evaluator.reset()
            self._computed = None  # (torchmetrics' cached compute: the value of the states replaced)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _synced(self) -> Evaluator:
        """An Evaluator holding the current (synced) states (a copy: the
        metric's own gathers the batches to come)."""
        self._fold()
        ev = copy.copy(self._evaluator)
        ev.load_state_dict(state_from_floats({k: float(getattr(self, k)) for k in ev._state_now()}))
        return ev

    def _metrics(self) -> Metrics:
        """The lmmetrics Metrics of the current (synced) states."""
        return self._synced().compute()

    def _value(self, v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float64, device=self.device)


def _state(name: str) -> property:
    """A state of an `_EvaluatorMetric` as torchmetrics reads it: with every
    batch in it. Reading it first adds the batch whose pass on a device was
    not waited for: a MetricCollection's compute group shares its first
    member's states with the others by reading them (after each update and
    before computing), and they would miss that batch."""
    def get(self: _EvaluatorMetric) -> Any:
        ev = self.__dict__.get("_evaluator")
        if ev is not None and ev._pending is not None:
            self._fold()
        return self._held[name]

    def put(self: _EvaluatorMetric, value: Any) -> None:
        self._held[name] = value

    return property(get, put, doc=f"the float64 sum {name!r} (a torchmetrics state)")


_STATE_NAMES = tuple(Evaluator()._state_now())
for _name in _STATE_NAMES:
    setattr(_EvaluatorMetric, _name, _state(_name))


class LanguageModelMetrics(_EvaluatorMetric):
    """Every metric of `lmmetrics.evaluate`, streamed, as a torchmetrics ``Metric``.

    ``compute()`` returns a dict of float64 tensors (``loss``, ``perplexity``,
    ``bits_per_token``, ``accuracy``, ``entropy``, the counts, and
    ``bits_per_byte`` with ``token_bytes``, ``kl`` and ``same_top`` after
    updates given ``reference_logits``), each key led by ``prefix``. The
    states are float64 sums with ``dist_reduce_fx="sum"`` (torchmetrics syncs
    them across ranks) and stay float64 under ``.to(dtype)``. No gradient
    flows.

    For Lightning it is also a mapping of names to one-value metrics, so that
    ``self.log_dict(self.val_metrics)`` logs each of ``fields`` under
    ``prefix + field`` (``metric["perplexity"]`` is one of them, for
    ``self.log``): each has a tensor ``compute()`` (the shared states' value)
    and its ``reset()`` resets the shared states, so that Lightning computes
    and resets the metric at the end of each epoch as it does any
    torchmetrics ``Metric``.

    Parameters
    ----------
    ignore_index : int or None, default None
        As for ``torchmetrics.text.Perplexity``: targets equal to it are not
        counted; negative targets are never counted.
    token_bytes : array_like or torch.Tensor, optional
        ``token_bytes[v]``, the UTF-8 byte length of token ``v`` (0 for
        special tokens), for ``bytes`` and ``bits_per_byte``.
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
    prefix : str, default ""
        Put before every key of ``compute()`` and of the mapping
        (``prefix="val/"`` gives ``"val/perplexity"``, ...).
    fields : sequence of str, optional
        The keys of `lmmetrics.Metrics.as_dict` the mapping holds (what
        ``self.log_dict`` logs). Default: the twelve first fields that have a
        value without reference logits (``bytes`` and ``bits_per_byte`` only
        with ``token_bytes``); name ``kl``, ``same_top``, ``loss_ref``,
        ``loss_diff`` to log them (nan while no update had
        ``reference_logits``), and ``<mean>_stderr``, ``perplexity_low`` /
        ``perplexity_high`` for the standard errors and the interval.
    **kwargs
        Passed to ``torchmetrics.Metric`` (``sync_on_compute``,
        ``dist_sync_on_step``, ...).

    Raises
    ------
    ValueError
        An unknown field, no field, or ``bytes`` / ``bits_per_byte`` without
        ``token_bytes``.

    Examples
    --------
    >>> import torch
    >>> from lmmetrics.torchmetrics import LanguageModelMetrics
    >>> metric = LanguageModelMetrics(token_bytes=torch.full((10,), 2))
    >>> metric.update(torch.zeros(2, 5, 10), torch.randint(0, 10, (2, 5)))   # uniform over 10 tokens
    >>> out = metric.compute()
    >>> int(out["tokens"]), round(float(out["perplexity"]), 4)
    (10, 10.0)
    >>> val = LanguageModelMetrics(prefix="val/", fields=("loss", "perplexity"))
    >>> list(val)                      # what self.log_dict(val) logs, in a LightningModule
    ['val/loss', 'val/perplexity']
    """

    def __init__(self, ignore_index: Optional[int] = None, *, token_bytes: Any = None, shift: Optional[bool] = None,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, prefix: str = "",
                 fields: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        super().__init__(ignore_index, token_bytes=token_bytes, shift=shift, softcap=softcap,
                         num_threads=num_threads, **kwargs)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if fields is None:
            skip = _WITH_REFERENCE + (() if token_bytes is not None else _WITH_TOKEN_BYTES)
            fields = [f for f in _BASE if f not in skip]
        elif isinstance(fields, str):
            raise TypeError(f"fields must be a sequence of field names, got the str {fields!r}")
        fields = list(fields)
        unknown = [f for f in fields if f not in _FIELDS]
        if unknown or not fields or len(set(fields)) != len(fields):
            raise ValueError(f"fields must name distinct fields of lmmetrics.Metrics, one or more of "
                             f"{list(_FIELDS)}; got {fields}")
        if token_bytes is None and any(f in _WITH_TOKEN_BYTES for f in fields):
            raise ValueError("the fields bytes and bits_per_byte need token_bytes")
        self.prefix = prefix
        self._fields = ModuleDict({f: _Field(self, f) for f in fields})

    def compute(self) -> Dict[str, torch.Tensor]:
        """Every metric over the batches seen (synced across ranks).

        Returns
        -------
        dict of str to torch.Tensor
            float64 scalars, one per field of `lmmetrics.Metrics` that has
            a value, each key led by ``prefix``.
        """
        return {self.prefix + k: self._value(v) for k, v in self._metrics().as_dict().items() if v is not None}

    # A mapping of prefix + field to the one-value metric of that field
    # (what Lightning's log_dict takes): not a collections.abc.Mapping, whose
    # __eq__ would replace torchmetrics' own.

    def keys(self) -> KeysView[str]:
        """The logged names, ``prefix + field`` for each of ``fields``."""
        return self._named().keys()

    def values(self) -> ValuesView[Metric]:
        """The one-value metric of each field, in the order of `keys`."""
        return self._named().values()

    def items(self) -> ItemsView[str, Metric]:
        """``(prefix + field, one-value metric)`` pairs, as ``self.log_dict`` reads them."""
        return self._named().items()

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # Metric's is None: not iterable
        return iter(self._named())

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._named()

    def __getitem__(self, name: Any) -> Any:
        """The one-value metric of a field, by its logged name (``"val/loss"``)
        or its field name (``"loss"``); ``self.log(name, metric["loss"])``
        logs it."""
        if not isinstance(name, str):
            return super().__getitem__(name)  # torchmetrics' metric[idx]
        named = self._named()
        if name in named:
            return named[name]
        if name in self._fields:
            return self._fields[name]
        raise KeyError(f"{name!r}: this metric holds {list(named)} (fields= chooses them)")

    def _named(self) -> Dict[str, Metric]:
        return {self.prefix + f: cast(Metric, m) for f, m in self._fields.items()}

    def _field_total(self, field: str) -> torch.Tensor:
        """The field's value over the batches seen (from compute(), cached
        until the next update; nan where it has none)."""
        total = self.compute().get(self.prefix + field)
        return self._value(math.nan) if total is None else total

    def _field_batch(self, field: str) -> Optional[torch.Tensor]:
        """The field's value in the last forward's batch (None before one)."""
        cache = self._forward_cache
        return cache.get(self.prefix + field) if isinstance(cache, dict) else None


class _Field(Metric):
    """One field of a `LanguageModelMetrics`, as a metric whose
    ``compute()`` is a tensor (what Lightning logs): it holds no state of
    its own; ``compute`` reads the owner's (cached) result, ``reset`` resets
    the owner, and ``_forward_cache`` is the owner's last batch value, for
    ``on_step`` logging."""

    is_differentiable = False
    higher_is_better: Optional[bool] = None
    full_state_update = False
    _owner: Tuple[LanguageModelMetrics]

    def __init__(self, owner: LanguageModelMetrics, field: str) -> None:
        super().__init__()
        # a tuple, so that the owner is not registered as a submodule (a cycle)
        object.__setattr__(self, "_owner", (owner,))
        self.field = field

    @property  # type: ignore[override]
    def _forward_cache(self) -> Optional[torch.Tensor]:
        owner = self.__dict__.get("_owner")
        return None if owner is None else owner[0]._field_batch(self.field)

    @_forward_cache.setter
    def _forward_cache(self, _value: Any) -> None:
        pass  # the owner's forward sets it

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        return compute  # no cache or sync of its own: the owner's compute does both

    def update(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError(f"update the LanguageModelMetrics, not its field {self.field!r}")

    def compute(self) -> torch.Tensor:
        """The field's value over the batches seen (nan where it has none)."""
        return self._owner[0]._field_total(self.field)

    def reset(self) -> None:
        """Reset the owner (every field)."""
        super().reset()
        self._owner[0].reset()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.field!r})"


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

    def __init__(self, ignore_index: Optional[int] = None, *, shift: Optional[bool] = None,
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
    """Bits per byte with nanochat's semantics (`lmmetrics.bits_per_byte`),
    as a torchmetrics ``Metric``.

    Tokens whose ``token_bytes`` entry is 0 (special tokens) leave both sums.

    Parameters
    ----------
    token_bytes : array_like or torch.Tensor
        ``token_bytes[v]``, the UTF-8 byte length of token ``v``.
    ignore_index : int or None, default None
        As for ``torchmetrics.text.Perplexity``: targets equal to it are not
        counted; negative targets are never counted.
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
    **kwargs
        Passed to ``torchmetrics.Metric`` (``sync_on_compute``,
        ``dist_sync_on_step``, ...).

    Raises
    ------
    TypeError
        ``token_bytes`` None.

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

    def __init__(self, token_bytes: Any, ignore_index: Optional[int] = None, *, shift: Optional[bool] = None,
                 softcap: Optional[float] = None, num_threads: Optional[int] = None, **kwargs: Any) -> None:
        """Set up the metric; the parameters are described in the class's docstring.
        """
        if token_bytes is None:  # (else an error at the first compute, at the end of an epoch)
            raise TypeError("BitsPerByte needs token_bytes, the UTF-8 byte length of each token id; got None")
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
