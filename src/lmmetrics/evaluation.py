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

    A frozen dataclass. Means are over counted tokens (targets neither
    negative nor ``ignore_index``), nan when no token was counted; values in
    nats unless the name says bits. ``str()`` gives one line a field;
    :meth:`as_dict` a plain dict.

    Attributes
    ----------
    tokens : int
        Counted tokens.
    ignored : int
        Positions ignored.
    bytes : int or None
        UTF-8 bytes of the counted targets (with ``token_bytes``).
    nll_sum : float
        Summed NLL of the counted tokens.
    loss : float
        Mean NLL (cross-entropy).
    perplexity : float
        ``exp(loss)``.
    bits_per_token : float
        ``loss / ln 2``.
    bits_per_byte : float or None
        nanochat's bits per byte (with ``token_bytes``); inf when no byte was
        counted.
    accuracy : float
        Fraction of counted tokens whose argmax is the target (the lowest
        index wins ties).
    entropy : float
        Mean predictive entropy.
    kl : float or None
        Mean KL(P_ref || P_model) (with reference logits, else None).
    same_top : float or None
        Fraction of counted tokens whose argmax agrees with the reference's
        (with reference logits, else None).
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
        """The fields as a plain dict (JSON-ready).

        Returns
        -------
        dict
            Field name to value, in the order of the attributes.
        """
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
    """Streaming metrics: :meth:`update` per batch, :meth:`compute` at the end.

    Each update reads its logits once (NLL, entropy, argmax and, with
    ``reference_logits``, KL in the same pass) and adds to float64 sums, so
    updating chunk by chunk gives the numbers of one call on everything.
    ``kl`` and ``same_top`` are over the counted tokens of updates given
    reference logits (None when there were none). The settings of the data,
    fixed for a loop, are given here; :meth:`update` takes the batch only. No
    gradient flows: tensors are read detached.

    Parameters
    ----------
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for
        special tokens (:func:`lmmetrics.token_bytes` builds it from a
        tokenizer); one entry per column of the logits. Gives ``bytes`` and
        ``bits_per_byte``.
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
        or :func:`lmmetrics.model_logits`, which come with unshifted ids.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.
    nll_only : bool, default False
        Read the logits for the NLL alone (and the bytes with
        ``token_bytes``, the KL with reference logits): the loss, perplexity
        and bits per token / byte for less work a batch; ``accuracy`` and
        ``entropy`` are then nan.

    Raises
    ------
    ValueError
        An option out of range.
    TypeError
        An option of the wrong type.

    See Also
    --------
    evaluate : the same metrics from one call.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> rng = np.random.default_rng(0)
    >>> ev = lmmetrics.Evaluator(token_bytes=np.full(50, 2))
    >>> for _ in range(3):                                   # three batches
    ...     ev.update(rng.standard_normal((4, 8, 50), dtype=np.float32), rng.integers(0, 50, (4, 8)))
    >>> ev.all_reduce()      # sums across torch.distributed ranks; a no-op without them
    Evaluator(tokens=96, ignore_index=-100)
    >>> m = ev.compute()
    >>> m.tokens, m.bytes
    (96, 192)
    >>> round(m.bits_per_byte, 4) == round(m.bits_per_token / 2, 4)
    True
    """

    def __init__(self, *, token_bytes: Any = None, ignore_index: Optional[int] = -100,
                 shift: Optional[bool] = None, softcap: Optional[float] = None,
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
        """Forget everything seen (the settings stay).
        """
        self._state = _Sums()

    def check_vocab(self, n_cols: int) -> None:
        """Check ``token_bytes`` against a vocabulary before any batch.

        Nothing to check without ``token_bytes``; :meth:`update` checks each
        batch the same way.

        Parameters
        ----------
        n_cols : int
            The vocabulary size: the logits' last axis.

        Raises
        ------
        ValueError
            Unless ``token_bytes`` is a 1-D table of ``n_cols`` counts from 0 to
            2^32 - 1.
        """
        self._table(n_cols)

    def _table(self, n_cols: int) -> Optional[I64Array]:
        if self._token_bytes_in is None:
            return None
        if self._token_bytes is None or self._token_bytes.shape[0] != n_cols:
            self._token_bytes = as_table(self._token_bytes_in, n_cols, "token_bytes")
        return self._token_bytes

    def update(self, logits: Any, targets: Any, *, reference_logits: Any = None) -> None:
        """Add a batch.

        All or nothing: an error (or a KeyboardInterrupt) leaves the sums as they
        were.

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
        reference_logits : array_like, torch.Tensor, model output or None, default None
            The reference model's logits (keyword-only, so that two buffers of the
            same shape cannot be swapped): the distribution P_ref the expectation
            is taken over. Same shape as ``logits``; the dtype may differ (a
            float32 base against bfloat16 or float16 logits), each read in its
            own dtype. Gives ``kl`` and ``same_top``.

        Raises
        ------
        ValueError
            A counted target >= V, targets whose shape does not match the logits',
            NaN in the logits of a counted position, a counted row that is all
            -inf, or an option out of range.
        TypeError
            Integer logits or float targets.
        """
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
        """The metrics of everything seen so far.

        Returns
        -------
        Metrics
            As :func:`evaluate` would give over every batch at once.
        """
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
        """The bits per byte of everything seen so far.

        Returns
        -------
        float
            ``compute().bits_per_byte``; inf when no byte was counted.

        Raises
        ------
        ValueError
            For an Evaluator without ``token_bytes``.
        """
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
        """Add another Evaluator's sums to this one (e.g. from another worker).

        Parameters
        ----------
        other : Evaluator
            With the same ``token_bytes`` table.

        Returns
        -------
        Evaluator
            ``self``.

        Raises
        ------
        ValueError
            When ``other`` has another ``token_bytes`` table.
        """
        self._check_compatible(other)
        mine, theirs = asdict(self._state), asdict(other._state)
        self._state = _sums({k: v + theirs[k] for k, v in mine.items()})
        return self

    def state_dict(self) -> Dict[str, Union[int, float]]:
        """The sums as a dict of Python numbers (picklable, JSON-ready).

        Returns
        -------
        dict
            Counts (int) and float64 sums (float); :meth:`load_state_dict` takes it.
        """
        return asdict(self._state)

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the sums by those of :meth:`state_dict`.

        Parameters
        ----------
        state : mapping
            A :meth:`state_dict` (of this Evaluator or another one).

        Raises
        ------
        ValueError
            Negative, fractional or non-numeric counts, or a missing or unknown key.
        """
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
        """Sum the state across the ranks of ``torch.distributed``.

        Every rank ends with the global sums. A no-op when torch.distributed is
        not initialized. The sums travel as one float64 tensor, on the current
        CUDA device for the nccl backend, on the CPU otherwise.

        Parameters
        ----------
        group : torch.distributed process group, optional
            The group to reduce over (the default group when None).

        Returns
        -------
        Evaluator
            ``self``.
        """
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
             ignore_index: Optional[int] = -100, shift: Optional[bool] = None, softcap: Optional[float] = None,
             num_threads: Optional[int] = None) -> Metrics:
    """Every metric of :class:`Metrics` from one read of the logits.

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
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for
        special tokens (:func:`lmmetrics.token_bytes` builds it from a
        tokenizer); one entry per column of the logits. Gives ``bytes`` and
        ``bits_per_byte``.
    reference_logits : array_like, torch.Tensor, model output or None, default None
        The reference model's logits (keyword-only, so that two buffers of the
        same shape cannot be swapped): the distribution P_ref the expectation
        is taken over. Same shape as ``logits``; the dtype may differ (a
        float32 base against bfloat16 or float16 logits), each read in its
        own dtype. Gives ``kl`` and ``same_top``.
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
        or :func:`lmmetrics.model_logits`, which come with unshifted ids.
    softcap : float or None, default None
        Apply ``softcap * tanh(z / softcap)`` to every logit on the fly
        (Gemma, nanochat), to both buffers where there are two; a number in
        [1e-30, 1e30].
    num_threads : int or None, default None
        CPU threads, in [1, 1024]; ``None`` uses the OpenMP default
        (``OMP_NUM_THREADS``). The result does not depend on it.

    Returns
    -------
    Metrics
        Counts, loss, perplexity, bits per token (and per byte), accuracy,
        entropy (and KL, top-1 agreement).

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
    >>> m = lmmetrics.evaluate(logits, np.array([0, 2]), token_bytes=np.array([1, 1, 3]))
    >>> print(m)
    tokens          2
    ignored         0
    bytes           4
    nll_sum         0.916291
    loss            0.458145
    perplexity      1.58114
    bits_per_token  0.660964
    bits_per_byte   0.330482
    accuracy        1
    entropy         0.839376
    """
    ev = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift, softcap=softcap,
                   num_threads=num_threads)
    ev.update(logits, targets, reference_logits=reference_logits)
    return ev.compute()


def evaluate_bpb(model: Callable[[Any], Any], batches: Iterable[Tuple[Any, Any]], steps: int,
                 token_bytes: Any) -> float:
    """Bits per byte of ``model`` over ``steps`` batches: a drop-in for
    nanochat's ``loss_eval.evaluate_bpb``.

    Runs under ``torch.no_grad()``; the sums are all-reduced when
    torch.distributed is initialized.

    Parameters
    ----------
    model : callable
        ``model(x)`` returns logits (B, T, V), or an object with ``.logits``.
    batches : iterable of (x, y)
        Inputs and their targets (B, T), already aligned (y is x shifted by
        one); negative targets are ignored.
    steps : int
        How many batches to read.
    token_bytes : array_like or torch.Tensor
        ``token_bytes[v]`` is the byte length of token ``v``; 0 for special
        tokens, which leave both sums.

    Returns
    -------
    float
        ``sum NLL / (ln 2 * sum bytes)``; inf when no byte was counted.

    Raises
    ------
    ValueError
        As for :func:`lmmetrics.bits_per_byte`.

    Examples
    --------
    >>> import torch, lmmetrics
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = lambda x: torch.zeros(*x.shape, 8)               # uniform over 8 tokens: 3 bits a token
    >>> batches = iter([(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 8, (2, 4, 17))])
    >>> lmmetrics.evaluate_bpb(model, batches, 2, torch.full((8,), 2))   # 3 bits / 2 bytes
    1.5
    """
    import torch
    import torch.distributed as dist

    ev = Evaluator(token_bytes=token_bytes, ignore_index=-1, nll_only=True, shift=False)  # y is aligned with x
    it = iter(batches)
    with torch.no_grad():
        for _ in range(steps):
            x, y = next(it)
            ev.update(model(x), y)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ev.all_reduce()
    return ev.bits_per_byte()
