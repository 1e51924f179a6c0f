"""Every metric from one read of the logits, in one call or streamed.

:func:`evaluate` reads the logits once and returns :class:`Metrics`: the
NLL-based numbers (loss, perplexity, bits per token and per byte), top-1
accuracy, mean predictive entropy and, given reference logits, the mean KL
divergence and top-1 agreement. :class:`Evaluator` accumulates the same sums
batch by batch (float64), merges across workers and all-reduces across
``torch.distributed`` ranks. :func:`evaluate_bpb` is a drop-in for
nanochat's ``evaluate_bpb``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import numpy as np

from . import _engine
from ._inputs import as_index_array, as_table
from ._types import I64Array
from .convert import LN2, bits_per_unit, exp
from .metrics import unit_sums


@dataclass(frozen=True)
class Metrics:
    """What :func:`evaluate` and :meth:`Evaluator.compute` report.

    Means are over counted tokens (targets neither negative nor
    ``ignore_index``); nan when no token was counted. Values in nats unless
    the name says bits.
    """

    tokens: int                       #: counted tokens
    ignored: int                      #: positions ignored
    bytes: Optional[int]              #: UTF-8 bytes of the counted targets (with token_bytes)
    nll_sum: float                    #: summed NLL of the counted tokens
    loss: float                       #: mean NLL (cross-entropy)
    perplexity: float                 #: exp(loss)
    bits_per_token: float             #: loss / ln 2
    bits_per_byte: Optional[float]    #: nanochat's bpb (with token_bytes); inf without bytes
    accuracy: float                   #: fraction whose argmax is the target (lowest index on ties)
    entropy: float                    #: mean predictive entropy
    kl: Optional[float] = None        #: mean KL(P_ref || P_model) (with reference logits, else None)
    same_top: Optional[float] = None  #: fraction whose argmax agrees with the reference's

    def as_dict(self) -> Dict[str, Optional[float]]:
        """The fields as a plain dict (JSON-ready)."""
        return asdict(self)

    def __str__(self) -> str:
        rows = []
        for k, v in self.as_dict().items():
            if v is None:
                continue
            rows.append(f"{k:<16}{v}" if isinstance(v, int) else f"{k:<16}{v:.6g}")
        return "\n".join(rows)


@dataclass
class _Sums:
    """An Evaluator's state: counts and float64 sums over everything seen,
    in the order of :meth:`Evaluator.state_dict`."""

    tokens: int = 0
    ignored: int = 0
    bytes: int = 0
    correct: int = 0
    kl_tokens: int = 0
    same_top: int = 0
    nll_sum: float = 0.0
    nll_sum_bytes: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0


_COUNTS = tuple(f.name for f in fields(_Sums) if isinstance(f.default, int))  # the integer fields
_SUMS = tuple(f.name for f in fields(_Sums) if isinstance(f.default, float))


def _sums(values: Mapping[str, float]) -> _Sums:
    """The state holding ``values`` (every field's): counts rounded to
    integers (they may arrive as float64 sums), sums as floats."""
    st = _Sums()
    for k in _COUNTS:
        setattr(st, k, int(round(values[k])))
    for k in _SUMS:
        setattr(st, k, float(values[k]))
    return st


class Evaluator:
    """Streaming metrics: ``update`` per batch, ``compute`` at the end.

    >>> ev = Evaluator(token_bytes=token_bytes)          # doctest: +SKIP
    >>> for x, y in loader:                               # doctest: +SKIP
    ...     ev.update(model(x).logits, y)
    >>> ev.all_reduce()                                   # doctest: +SKIP
    >>> print(ev.compute().bits_per_byte)                 # doctest: +SKIP

    Each update reads its logits once (NLL, entropy, argmax and, with
    ``reference_logits``, KL in the same pass) and adds to float64 sums, so
    updating chunk by chunk gives the numbers of one call on everything.
    ``kl`` and ``same_top`` are over the counted tokens of updates given
    reference logits (None when there were none).

    The settings of the data, fixed for a loop, are given here:
    ``ignore_index`` (None: negative targets only), ``shift=True`` for
    unshifted inputs as Hugging Face passes them (``model(x).logits`` with
    ``labels``: position t is scored against ``labels[..., t + 1]``),
    ``softcap``. ``update`` takes the batch only. No gradient flows: tensors
    are read detached.

    ``nll_only=True`` reads the logits for the NLL alone (and the bytes
    with ``token_bytes``, the KL with reference logits): the loss,
    perplexity and bits per token / byte, for less work a batch; its
    ``accuracy`` and ``entropy`` are nan.
    """

    def __init__(self, *, token_bytes: Any = None, ignore_index: Optional[int] = -100,
                 shift: bool = False, softcap: Optional[float] = None,
                 num_threads: Optional[int] = None, nll_only: bool = False):
        self.ignore_index = _engine.check_ignore_index(ignore_index)
        self.shift = _engine.check_shift(shift)
        _engine.check_softcap(softcap)
        _engine.check_threads(num_threads)
        if not isinstance(nll_only, (bool, np.bool_)):
            raise TypeError(f"nll_only must be True or False, got {nll_only!r}")
        self.softcap = softcap
        self.num_threads = num_threads
        self.nll_only = bool(nll_only)
        self._token_bytes_in = token_bytes
        self._token_bytes: Optional[I64Array] = None
        self._state = _Sums()

    def reset(self) -> None:
        """Forget everything seen."""
        self._state = _Sums()

    def check_vocab(self, n_cols: int) -> None:
        """Check ``token_bytes`` against a vocabulary of ``n_cols`` (the
        logits' last axis) before any batch: ValueError unless it is a 1-D
        table of that length of counts from 0 to 2^32 - 1. Nothing to check
        without token_bytes. ``update`` checks each batch the same way."""
        self._table(n_cols)

    def _table(self, n_cols: int) -> Optional[I64Array]:
        if self._token_bytes_in is None:
            return None
        if self._token_bytes is None or self._token_bytes.shape[0] != n_cols:
            self._token_bytes = as_table(self._token_bytes_in, n_cols, "token_bytes")
        return self._token_bytes

    def update(self, logits: Any, targets: Any, *, reference_logits: Any = None) -> None:
        """Add a batch: logits (..., V) (or a model output with ``.logits``),
        targets (...), optional reference logits of the logits' shape (any
        logits dtype). All or nothing: an error (or a KeyboardInterrupt)
        leaves the sums as they were."""
        ref = reference_logits is not None
        full = not self.nll_only
        res = _engine.run(logits, targets, reference_logits, ignore_index=self.ignore_index,
                          shift=self.shift, softcap=self.softcap, num_threads=self.num_threads,
                          nll=True, entropy=full, argmax=full or ref, kl=ref)
        table = self._table(res.n_cols)
        st = replace(self._state)
        self._add(st, res, table, ref)
        self._state = st

    def _add(self, st: _Sums, res: _engine.RowResults, table: Optional[I64Array], ref: bool) -> None:
        n = res.n_counted
        nll = res.floats("nll")
        st.tokens += n
        st.ignored += nll.size - n
        st.nll_sum += res.nll_sum
        if table is None and self.nll_only and not ref:
            return
        counted = res.counted
        if table is not None:
            nbytes, nll_bytes = unit_sums(res, table)
            st.bytes += nbytes
            st.nll_sum_bytes += nll_bytes
        if not self.nll_only:
            st.correct += int(np.count_nonzero(counted & (res.indices("argmax") == res.target_ids)))
            st.entropy_sum += float(np.sum(res.floats("entropy")))
        if ref:
            st.kl_tokens += n
            st.kl_sum += float(np.sum(res.floats("kl")))
            st.same_top += int(np.count_nonzero(counted & (res.indices("argmax") == res.indices("ref_argmax"))))

    def compute(self) -> Metrics:
        """The metrics of everything seen so far."""
        st = self._state
        n = st.tokens
        loss = st.nll_sum / n if n else math.nan
        has_bytes = self._token_bytes_in is not None
        kn = st.kl_tokens
        return Metrics(
            tokens=n, ignored=st.ignored, bytes=st.bytes if has_bytes else None,
            nll_sum=st.nll_sum, loss=loss, perplexity=exp(loss) if n else math.nan,
            bits_per_token=loss / LN2, bits_per_byte=self.bits_per_byte() if has_bytes else None,
            accuracy=st.correct / n if n and not self.nll_only else math.nan,
            entropy=st.entropy_sum / n if n and not self.nll_only else math.nan,
            kl=st.kl_sum / kn if kn else None,
            same_top=st.same_top / kn if kn else None)

    def bits_per_byte(self) -> float:
        """The bits per byte of everything seen so far, as
        ``compute().bits_per_byte`` (inf when no byte was counted);
        ValueError for an Evaluator without token_bytes."""
        if self._token_bytes_in is None:
            raise ValueError("bits per byte needs token_bytes (Evaluator(token_bytes=...))")
        return bits_per_unit(self._state.nll_sum_bytes, self._state.bytes)

    def _check_compatible(self, other: Evaluator) -> None:
        if not isinstance(other, Evaluator):
            raise TypeError(f"can only merge another Evaluator, got {type(other).__name__}")
        if (other.ignore_index, other.softcap) != (self.ignore_index, self.softcap):
            raise ValueError("cannot merge Evaluators with different ignore_index or softcap")
        if other.nll_only != self.nll_only:
            raise ValueError("cannot merge an nll_only Evaluator and one computing every metric")
        if (other._token_bytes_in is None) != (self._token_bytes_in is None):
            raise ValueError("cannot merge an Evaluator with token_bytes and one without")
        if self._token_bytes_in is not None and not _same_table(self._token_bytes_in, other._token_bytes_in):
            raise ValueError("cannot merge Evaluators with different token_bytes tables")

    def merge(self, other: Evaluator) -> Evaluator:
        """Add another Evaluator's sums to this one (e.g. from another worker)."""
        self._check_compatible(other)
        mine, theirs = asdict(self._state), asdict(other._state)
        self._state = _sums({k: v + theirs[k] for k, v in mine.items()})
        return self

    def state_dict(self) -> Dict[str, Union[int, float]]:
        """The sums as a dict of Python numbers (picklable, JSON-ready)."""
        return asdict(self._state)

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the sums by those of :meth:`state_dict`."""
        names = set(_COUNTS + _SUMS)
        missing = names - set(state)
        unknown = set(state) - names
        if missing or unknown:
            raise ValueError(f"not an Evaluator state: missing {sorted(missing)}, unknown {sorted(unknown)}")
        new: Dict[str, Union[int, float]] = {}
        for k in _COUNTS:
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"Evaluator state: {k} must be a non-negative integer, got {v!r}")
            new[k] = int(v)
        for k in _SUMS:
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) or v < 0:
                raise ValueError(f"Evaluator state: {k} must be a non-negative number, got {v!r}")
            new[k] = float(v)
        if new["correct"] > new["tokens"] or new["same_top"] > new["kl_tokens"] or new["kl_tokens"] > new["tokens"]:
            raise ValueError("Evaluator state: inconsistent counts (correct, kl_tokens and same_top "
                             "cannot exceed tokens)")
        self._state = _sums(new)

    def all_reduce(self, group: Any = None) -> Evaluator:
        """Sum the state across the ranks of ``torch.distributed`` (every
        rank ends with the global sums). A no-op when torch.distributed is
        not initialized. The sums travel as one float64 tensor, on the
        current CUDA device for the nccl backend, on the CPU otherwise."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        state = self.state_dict()
        device: Union[str, torch.device] = "cpu"
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        vals = torch.tensor([float(v) for v in state.values()], dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
        self._state = _sums(dict(zip(state, vals.cpu().tolist())))
        return self

    def __repr__(self) -> str:
        return f"Evaluator(tokens={self._state.tokens}, ignore_index={self.ignore_index})"


def state_from_floats(values: Mapping[str, float]) -> Dict[str, Union[int, float]]:
    """An Evaluator state from sums carried as floats (counts rounded back
    to integers), e.g. after a float64 all-reduce."""
    return {k: int(round(v)) if k in _COUNTS else float(v) for k, v in values.items()}


def _same_table(a: Any, b: Any) -> bool:
    """Whether two token_bytes tables hold the same counts."""
    if a is b:
        return True
    x, y = as_index_array(a, "token_bytes"), as_index_array(b, "token_bytes")
    return x.shape == y.shape and bool(np.array_equal(x, y))


def evaluate(logits: Any, targets: Any, *, token_bytes: Any = None, reference_logits: Any = None,
             ignore_index: Optional[int] = -100, shift: bool = False, softcap: Optional[float] = None,
             num_threads: Optional[int] = None) -> Metrics:
    """Every metric of :class:`Metrics` from one read of the logits.

    ``logits`` (..., V) and ``targets`` (...) as for :func:`cross_entropy`
    (``shift``, ``ignore_index`` likewise); ``token_bytes[v]`` the UTF-8
    byte length of token v (0 for special tokens) for bits per byte;
    ``reference_logits`` (same shape, any logits dtype) for the mean
    KL(P_ref || P_model) and the top-1 agreement.
    """
    ev = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift, softcap=softcap,
                   num_threads=num_threads)
    ev.update(logits, targets, reference_logits=reference_logits)
    return ev.compute()


def evaluate_bpb(model: Callable[[Any], Any], batches: Iterable[Tuple[Any, Any]], steps: int,
                 token_bytes: Any) -> float:
    """Bits per byte of ``model`` over ``steps`` batches: a drop-in for
    nanochat's ``loss_eval.evaluate_bpb``.

    ``model(x)`` returns logits (B, T, V) (or an object with ``.logits``);
    ``batches`` yields ``(x, y)`` with targets y (B, T), negative targets
    ignored; ``token_bytes[v]`` is the byte length of token v, 0 for special
    tokens, which leave both sums. Runs under ``torch.no_grad()``; the sums
    are all-reduced when torch.distributed is initialized. Returns
    ``sum NLL / (ln 2 * sum bytes)``, inf when no byte was counted.
    """
    import torch
    import torch.distributed as dist

    ev = Evaluator(token_bytes=token_bytes, ignore_index=-1, nll_only=True)
    it = iter(batches)
    with torch.no_grad():
        for _ in range(steps):
            x, y = next(it)
            ev.update(model(x), y)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ev.all_reduce()
    return ev.bits_per_byte()
