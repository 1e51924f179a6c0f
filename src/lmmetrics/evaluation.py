"""Every metric from one read of the logits, in one call or streamed.

`evaluate` reads the logits once and returns `Metrics`: the
NLL-based numbers (loss, perplexity, bits per token and per byte), top-1
accuracy, mean predictive entropy and, given reference logits, the mean KL
divergence and top-1 agreement. `Evaluator` accumulates the same sums
batch by batch (float64), merges across workers and all-reduces across
``torch.distributed`` ranks. `evaluate_bpb` is a drop-in for
nanochat's ``evaluate_bpb``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import numbers
import operator
import os
import threading
import weakref
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar, Union, cast

import numpy as np
import numpy.typing as npt

from . import _engine
from ._engine.checks import check_positive_int
from ._engine.inputs import as_index_array, as_table
from ._engine.request import fsum
from ._spread import clustered_stderr, interval, mean_stderr, ratio_stderr, sample_mean, sample_stderr
from ._engine.types import F64Array, I64Array
from .convert import LN2, bits_per_unit, exp
from .documents import COLUMNS, DocumentSums, Documents
from .metrics import units_of
from .ranking import Calibration, calibration_of
from .ranking import _check_bins


class StandardErrors(Dict[str, float]):
    """``Metrics.stderr``: a dict of standard errors by name whose KeyError
    says what it holds, and for a perplexity what to use instead."""

    _where = "stderr"
    #: a perplexity's mean loss and 95% interval, by name
    _perplexities = {"perplexity": ("loss", "perplexity_interval"), "macro_perplexity": ("macro_loss", None)}

    def __missing__(self, key: str) -> float:
        if key in self._perplexities:
            loss, iv = self._perplexities[key]
            interval = iv or f"exp({loss} -/+ 1.96 {self._where}[{loss!r}])"
            raise KeyError(f"{self._where} has no {key!r}: a perplexity is exp of a mean loss and its "
                           f"uncertainty is not symmetric; use {interval} (95%), or the delta method's "
                           f"standard error {key} * {self._where}[{loss!r}]")
        raise KeyError(f"{self._where} has no {key!r}; it has {sorted(self)}")


class DocumentStandardErrors(StandardErrors):
    """``Metrics.stderr_documents``: as `StandardErrors`."""

    _where = "stderr_documents"
    _perplexities = {"perplexity": ("loss", "perplexity_interval_documents")}


@dataclass(frozen=True)
class Metrics:
    """What `evaluate` and `Evaluator.compute` report.

    A frozen dataclass. Means are over counted tokens (targets neither
    negative nor ``ignore_index``), nan when no token was counted; values in
    nats unless the name says bits. ``str()`` gives one line a field, each
    mean with ``± <standard error>`` labelled by its units: ``(se, tokens)``
    is ``stderr[name]`` with tokens taken as independent, ``(se,
    documents)`` has documents as the units (``stderr_documents[name]`` for
    a token mean, ``stderr[name]`` for a ``macro_*`` or ``mean_perplexity``);
    the perplexity's 95% intervals are labelled the same way.
    `as_dict` gives a plain dict.

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
    loss_ref : float or None
        The reference model's mean NLL on the same tokens (with reference
        logits).
    loss_diff : float or None
        Mean over those tokens of NLL(model) - NLL(reference): the paired
        difference a quantization report needs (``stderr["loss_diff"]`` is
        its paired standard error; llama.cpp's ln(PPL(Q)/PPL(base))).
    stderr : dict
        The standard error of each mean, by name: ``loss`` (the sample
        standard deviation of the counted tokens' NLL over the square root of
        their count), ``bits_per_token``, ``bits_per_byte`` (a ratio of sums:
        the delta method), ``accuracy``, ``entropy``, ``kl``, ``same_top``,
        ``loss_diff``, and with ``document_ids`` each ``macro_*`` and
        ``mean_perplexity`` (the sample standard deviation over documents
        over the square root of their count). Tokens are taken as
        independent; nan below two tokens. A perplexity has none (it is the
        exponential of a mean, its uncertainty is not symmetric): the
        KeyError for ``stderr["perplexity"]`` says to use
        ``perplexity_interval``, or the delta method's ``perplexity *
        stderr["loss"]``.
    perplexity_interval : tuple of float or None
        95% interval of the perplexity, ``exp(loss -/+ z stderr["loss"])``,
        z = 1.959964 (the normal 97.5% quantile).
    documents : int or None
        With ``document_ids``: the documents with at least one counted token.
    macro_loss, macro_perplexity, macro_bits_per_token, macro_bits_per_byte, macro_accuracy, macro_entropy, macro_kl : float or None
        With ``document_ids``: the mean over documents of each document's
        mean (``macro_perplexity = exp(macro_loss)``; ``macro_bits_per_byte``
        over documents with a byte, ``macro_kl`` over those with reference
        logits).
    mean_perplexity : float or None
        With ``document_ids``: the arithmetic mean over documents of each
        document's perplexity ``exp(loss_d)``, the ``mean_perplexity`` of
        Hugging Face ``evaluate``'s "perplexity" metric (a document is a
        text there). ``macro_perplexity`` is their geometric mean
        (``exp`` of the mean of the documents' losses), never above it: the
        arithmetic mean weighs the hardest documents most, one text of
        perplexity 1000 among ninety-nine of 10 moves it from 10 to 19.9
        and ``macro_perplexity`` to 10.5.
    stderr_documents : dict
        With ``document_ids``: the standard errors of the token means
        (``loss``, ``bits_per_token``, ``bits_per_byte``, ``accuracy``,
        ``entropy``, ``kl``) clustered by document, the honest ones when
        tokens of a document are not independent (they are not: a document
        has a topic, a style, a difficulty). Usually larger than ``stderr``.
        Over the documents that hold the mean's tokens (``bits_per_byte``: those
        with a byte, ``kl``: those with reference logits), as the macro means.
    perplexity_interval_documents : tuple of float or None
        95% interval of the perplexity from the clustered standard error.
    per_document : Documents or None
        With ``document_ids``: each document's values (numpy arrays), and
        lm-eval's per-document aggregations.
    top_k_accuracy : dict
        With ``top_k``: for each k, the share of counted tokens whose rank
        (the number of logits above the target's, plus those equal to it at
        a lower index: ties go to the lowest index, so ``top_k_accuracy[1]``
        equals ``accuracy``) is below k; in
        `as_dict` as ``top_<k>_accuracy``.
    mean_reciprocal_rank : float or None
        With ``top_k``: the mean of ``1 / (rank + 1)``.
    ece : float or None
        With ``calibration_bins``: the expected calibration error of the
        top token's probability against top-1 correctness.
    calibration : Calibration or None
        With ``calibration_bins``: the reliability-diagram bins.
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
    loss_ref: Optional[float] = None  #: the reference's mean NLL on the same tokens
    loss_diff: Optional[float] = None  #: mean NLL(model) - NLL(reference), paired
    stderr: Mapping[str, float] = field(default_factory=lambda: StandardErrors())  #: standard error of each mean
    perplexity_interval: Optional[Tuple[float, float]] = None  #: 95% interval
    documents: Optional[int] = None    #: documents with a counted token (with document_ids)
    macro_loss: Optional[float] = None
    macro_perplexity: Optional[float] = None
    mean_perplexity: Optional[float] = None  #: mean over documents of exp(document loss) (HF evaluate's)
    macro_bits_per_token: Optional[float] = None
    macro_bits_per_byte: Optional[float] = None
    macro_accuracy: Optional[float] = None
    macro_entropy: Optional[float] = None
    macro_kl: Optional[float] = None
    stderr_documents: Mapping[str, float] = field(default_factory=lambda: DocumentStandardErrors())  #: by document
    perplexity_interval_documents: Optional[Tuple[float, float]] = None
    per_document: Optional[Documents] = field(default=None, repr=False, compare=False)
    top_k_accuracy: Mapping[int, float] = field(default_factory=dict)  #: with top_k: k -> share with rank < k
    mean_reciprocal_rank: Optional[float] = None  #: with top_k: mean of 1 / (rank + 1)
    ece: Optional[float] = None        #: with calibration_bins: expected calibration error
    calibration: Optional[Calibration] = field(default=None, repr=False, compare=False)

    def as_dict(self) -> Dict[str, Optional[float]]:
        """The values as a flat dict of numbers (JSON-ready).

        Each field in the order of the attributes: the first twelve always
        (None where they do not apply), the later ones only when they apply
        (with reference logits, with ``document_ids``); ``stderr`` as ``<name>_stderr`` after its mean,
        ``stderr_documents`` as ``<name>_stderr_documents``, the intervals as
        ``perplexity_low`` / ``perplexity_high`` (``..._documents``);
        ``per_document`` is left out (it has its own ``as_dict``).

        Returns
        -------
        dict
        """
        out: Dict[str, Optional[float]] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("stderr", "stderr_documents", "per_document", "calibration"):
                continue
            if f.name == "top_k_accuracy":
                for k, acc in self.top_k_accuracy.items():
                    out[f"top_{k}_accuracy"] = acc
                    out[f"top_{k}_accuracy_stderr"] = self.stderr.get(f"top_{k}_accuracy")
                continue
            if f.name.startswith("perplexity_interval"):
                suffix = f.name[len("perplexity_interval"):]
                if v is not None:
                    out["perplexity_low" + suffix], out["perplexity_high" + suffix] = v
                continue
            if v is None and f.name in _LATER:
                continue
            out[f.name] = v
            if f.name in self.stderr:
                out[f.name + "_stderr"] = self.stderr[f.name]
            if f.name in self.stderr_documents:
                out[f.name + "_stderr_documents"] = self.stderr_documents[f.name]
        return out

    def __str__(self) -> str:
        skip = ("stderr", "stderr_documents", "per_document", "perplexity_interval",
                "perplexity_interval_documents", "calibration", "top_k_accuracy")
        shown = [(f.name, getattr(self, f.name)) for f in fields(self)
                 if f.name not in skip and getattr(self, f.name) is not None]
        shown += [(f"top_{k}_accuracy", v) for k, v in self.top_k_accuracy.items()]
        width = max(16, max(len(k) for k, _ in shown) + 2)
        rows = []
        for k, v in shown:
            if isinstance(v, int):
                rows.append(f"{k:<{width}}{v}")
                continue
            line = f"{k:<{width}}{v:.6g}"
            # a macro mean's standard error has documents as its units (it is a mean over them)
            over = "documents" if k.startswith("macro_") or k == "mean_perplexity" else "tokens"
            for d, units in ((self.stderr, over), (self.stderr_documents, "documents")):
                if k in d and not math.isnan(d[k]):
                    line += f" ± {d[k]:.2g} (se, {units})"
            if k == "perplexity":
                for iv, units in ((self.perplexity_interval, "tokens"),
                                  (self.perplexity_interval_documents, "documents")):
                    if iv is not None and not math.isnan(iv[0]):
                        line += f" [{iv[0]:.6g}, {iv[1]:.6g}] (95%, {units})"
            rows.append(line)
        return "\n".join(rows)


#: the fields of Metrics after same_top, in as_dict only where they apply
_LATER = frozenset(f.name for f in fields(Metrics)[[f.name for f in fields(Metrics)].index("same_top") + 1:])


@dataclass
class _Sums:
    """An Evaluator's state: counts and float64 sums over everything seen,
    in the order of `Evaluator.state_dict`."""

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
    # squares and products for the standard errors (Metrics.stderr)
    nll_sq: float = 0.0          # sum of nll^2
    nll_sq_bytes: float = 0.0    # sum of nll^2 over the tokens in the byte sums
    nll_bytes_product: float = 0.0  # sum of nll * bytes
    bytes_sq: float = 0.0        # sum of bytes^2
    entropy_sq: float = 0.0
    kl_sq: float = 0.0
    # paired with the reference (tokens with reference logits: kl_tokens)
    nll_sum_paired: float = 0.0  # sum of the model's nll over them
    ref_nll_sum: float = 0.0     # sum of the reference's nll over them
    diff_sq: float = 0.0         # sum of (nll - ref_nll)^2


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


def _ids_per_position(doc: npt.NDArray[np.integer[Any]], shape: Tuple[int, ...]) -> npt.NDArray[np.integer[Any]]:
    """document_ids as one id per position of targets shaped ``shape``, by
    the one rule that never guesses: exactly ``shape`` is one id per
    position; a 0-d id is one for all; for targets of two or more axes,
    exactly ``shape[:1]`` is one id per sequence (first-axis index), repeated
    along the others. Anything else is an error (a (T,) row is never
    broadcast over the sequences, even where B == T)."""
    if doc.shape == shape:
        return doc
    if doc.ndim == 0 or (len(shape) >= 2 and doc.shape == shape[:1]):
        return np.broadcast_to(doc.reshape(doc.shape + (1,) * (len(shape) - doc.ndim)), shape)
    per_sequence = f", one per sequence {shape[:1]}" if len(shape) >= 2 else ""
    raise ValueError(f"document_ids shape {doc.shape} does not match the targets shape {shape}: give one id per "
                     f"position {shape}{per_sequence} or one for all (a scalar)")


_F = TypeVar("_F", bound=Callable[..., Any])


def _one_at_a_time(method: _F) -> _F:
    """An Evaluator method that reads or changes its sums, run while it holds
    the Evaluator's lock: updates from several threads run one at a time
    (each pass has the OpenMP threads), and a read sees whole batches
    only."""
    def locked(self: Evaluator, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    # (the method's name, docstring, module and annotations: typing.get_type_hints and
    # inspect.signature read the method's)
    return cast(_F, functools.update_wrapper(locked, method))


@contextlib.contextmanager
def both_held(a: threading.RLock, b: threading.RLock) -> Iterator[None]:
    """Two objects' locks (a merge: an update of either waits), taken in one
    order whichever is named first, so that two threads merging each into
    the other never wait on each other."""
    first, second = sorted((a, b), key=id)
    with first, second:
        yield


# every Evaluator, for `_free_locks_after_fork`
_EVALUATORS: weakref.WeakSet[Evaluator] = weakref.WeakSet()


def _free_locks_after_fork() -> None:
    """In a forked child, the lock of an Evaluator that another thread of
    the parent held (an update on its way) is made anew: that thread is not
    in the child, and every call would wait for it for ever. The child's
    Evaluator holds the batches added before that update."""
    for ev in list(_EVALUATORS):
        if ev._lock.acquire(blocking=False):  # (free, or held by this thread, which the child has)
            ev._lock.release()
        else:
            ev._new_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_locks_after_fork)


class Evaluator:
    """Streaming metrics: `update` per batch, `compute` at the end.

    Each update reads its logits once (NLL, entropy, argmax and, with
    ``reference_logits``, KL in the same pass) and adds to float64 sums, so
    updating chunk by chunk gives the numbers of one call on everything.
    ``kl`` and ``same_top`` are over the counted tokens of updates given
    reference logits (None when there were none). The settings of the data,
    fixed for a loop, are given here; `update` takes the batch only. No
    gradient flows: tensors are read detached.

    Parameters
    ----------
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for
        special tokens (`lmmetrics.token_bytes` builds it from a
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
        or `lmmetrics.model_logits`, which come with unshifted ids.
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
    top_k : int, sequence of int or None, default None
        Also count each target's rank (the number of logits above its own,
        plus those equal to it at a lower index, one compare per logit in
        the same pass; see ``lmmetrics.token_rank``): ``top_k_accuracy`` for each
        k (each in [1, V]) and ``mean_reciprocal_rank``. None: no rank, no
        cost.
    calibration_bins : int or None, default None
        Also bin the top token's probability (free in the pass) against
        top-1 correctness into this many equal-width bins, at most 100,000
        (each bin is stored, empty or not): ``ece`` and ``calibration``.
        None: nothing, no cost.

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
                 num_threads: Optional[int] = None, nll_only: bool = False,
                 top_k: Union[None, int, Iterable[int]] = None, calibration_bins: Optional[int] = None):
        self.top_k = _check_top_k(top_k)
        self.calibration_bins = None if calibration_bins is None else _check_bins(calibration_bins,
                                                                                  "calibration_bins")
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
        self._digest: Optional[Tuple[int, str]] = None  # token_bytes for all_reduce's check
        self._state = _Sums()
        self._docs: Optional[DocumentSums] = None  # with document_ids
        self._ranks = _RankSums(self.top_k) if self.top_k else None  # with top_k
        self._cal = self._no_calibration()  # with calibration_bins
        # after all_reduce, this rank's own sums (the sums above are every rank's until the next update,
        # merge or load; a later all_reduce sums the own ones again, never the sums it made): `_own_sums`
        self._own: Optional[_Held] = None
        # the batch on a CUDA device whose pass is launched, not yet added
        # (`_drain`: at the next update or read), the errors such passes found (raised at the next read,
        # `_settle`), and the updates so far (to name a batch in an error)
        self._pending: Optional[_Pending] = None
        self._errors: List[Tuple[int, ValueError]] = []
        self._updates = 0
        self._new_lock()

    def _no_calibration(self) -> Optional[Calibration]:
        return None if self.calibration_bins is None else Calibration.from_arrays([], [], self.calibration_bins)

    #: the vocabulary size (the logits' last axis) of the batches added, None before one (and after
    #: `reset` or `load_state_dict`): a batch, or a merged Evaluator's batches, of another is an error
    _vocab: Optional[int] = None

    @_one_at_a_time
    def reset(self) -> None:
        """Forget everything seen, a batch not yet added and the errors not
        yet raised included (the settings stay).
        """
        self._clear_sums()
        self._vocab = None
        self._pending = None
        self._errors = []
        self._updates = 0

    def _clear_sums(self) -> None:
        self._state = _Sums()
        self._docs = None
        self._ranks = _RankSums(self.top_k) if self.top_k else None
        self._cal = self._no_calibration()
        self._own = None

    def _own_sums(self) -> _Held:
        """This rank's own sums: what an update or merge adds to and what
        all_reduce sums (the sums themselves, unless they are an
        all_reduce's)."""
        return self._own if self._own is not None else (self._state, self._docs, self._ranks, self._cal)

    def check_vocab(self, n_cols: int) -> None:
        """Check ``token_bytes`` against a vocabulary before any batch.

        Nothing to check without ``token_bytes``; `update` checks each
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

    def update(self, logits: Any, targets: Any, *, reference_logits: Any = None,
               document_ids: Any = None) -> None:
        """Add a batch.

        All or nothing: an error (or a KeyboardInterrupt) leaves the sums as they
        were. Logits on a CUDA device are not waited for: the pass is
        launched, its results' transfer queued, and the batch added at the
        next update (which waits for that pass only, not for the work queued
        after it) or read of the sums (`compute`, `state_dict`,
        `all_reduce`, `merge`, `bits_per_byte`); until then the Evaluator
        holds the batch's logits (rows with +inf logits are read again
        then: change them in place only after that). An error the pass
        finds on the device (a target out of range, NaN or all -inf logits
        in a counted row) is raised at the next read, naming the update and
        the row; that batch is not added, the others are.

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
            own dtype. Gives ``kl``, ``same_top``, ``loss_ref`` and ``loss_diff``.
        document_ids : array_like, torch.Tensor, int or None, default None
            Integer document ids: shaped like ``targets``, one per position
            (shifted with them under ``shift=True``: a position belongs to
            the document of the token it predicts); for targets (B, T, ...),
            shaped (B,), one per sequence; or one int for the whole batch.
            No other shape is taken: a (T,) row is never broadcast over the
            sequences, even when B == T (it is one id per sequence then).
            Positions with one id form one document, across batches too.
            Gives the ``macro_*`` means, ``mean_perplexity``, the clustered
            ``stderr_documents`` and ``per_document``. Every batch of an
            Evaluator has them, or none.

        Raises
        ------
        ValueError
            A counted target >= V, targets whose shape does not match the logits',
            NaN in the logits of a counted position, a counted row that is all
            -inf, ``document_ids`` of a shape other than those above (or given
            for some batches only), logits of another vocabulary size (last
            axis) than the batches before (since the Evaluator was made,
            reset or loaded), or an option out of range.
        TypeError
            Integer logits, float targets or float ``document_ids``.
        """
        self._update_rows(logits, targets, reference_logits=reference_logits, document_ids=document_ids, defer=True)

    @_one_at_a_time
    def _update_rows(self, logits: Any, targets: Any, *, reference_logits: Any = None, document_ids: Any = None,
                     defer: bool = False, **more: bool) -> _engine.RowResults:
        """`update`, returning the pass's per-row results (for the CLI's
        per-token export); ``more`` asks the pass for further outputs. With
        defer, a pass on a CUDA device is not waited for: the batch is added
        at `_settle` (the results returned are then not yet computed)."""
        self._drain()  # (the batch before, on a device: added now, before this one launches)
        self._updates += 1  # (every call, one that raises at once too: an error kept names the user's count)
        docs = self._document_rows(document_ids, targets)
        res = self._pass(logits, targets, reference_logits, defer, **more)
        _check_same_vocab(self._vocab, res.n_cols, "this batch's logits have")
        rows = math.prod(res.lead_shape)
        if docs is not None and docs.size != rows:
            raise ValueError(f"document_ids give {docs.size} positions, the logits {rows}")
        table = self._table(res.n_cols)
        ref = reference_logits is not None
        if res.pending is not None:
            self._pending = _Pending(self._updates, res, table, ref, docs)
            return res
        self._take(res, table, ref, docs)
        return res

    def _pass(self, logits: Any, targets: Any, reference_logits: Any = None, defer: bool = False,
              **more: bool) -> _engine.RowResults:
        """The pass over a batch for what this Evaluator sums (and ``more``),
        nothing added yet."""
        ref = reference_logits is not None
        full = not self.nll_only
        if self.top_k:
            more["rank"] = True
        if self.calibration_bins is not None:
            more["top_logprob"] = True
        res = _engine.run(logits, targets, reference_logits, ignore_index=self.ignore_index,
                          shift=self.shift, softcap=self.softcap, num_threads=self.num_threads,
                          nll=True, entropy=full, argmax=full or ref or self.calibration_bins is not None,
                          kl=ref, ref_nll=ref, defer=defer, **more)
        if self.top_k and self.top_k[-1] > res.n_cols:
            raise ValueError(f"top_k {self.top_k[-1]} is above the vocabulary size {res.n_cols}")
        return res

    def _take(self, res: _engine.RowResults, table: Optional[I64Array], ref: bool,
              docs: Optional[I64Array]) -> None:
        """Add a pass's results to this rank's own sums (all or nothing)."""
        own, own_docs, own_ranks, own_cal = self._own_sums()
        st = replace(own)
        doc_sums = None if docs is None else (own_docs.copy() if own_docs is not None else DocumentSums())
        self._add(st, res, table, ref, docs, doc_sums)
        ranks = None if own_ranks is None else own_ranks.plus(res)
        cal = None if own_cal is None else own_cal.add(calibration_of(res, own_cal.bins))
        self._state, self._docs, self._ranks, self._cal, self._own = st, doc_sums, ranks, cal, None
        self._vocab = res.n_cols

    @_one_at_a_time
    def _sequence_states(self, logits: Any, targets: Any) -> List[Dict[str, Any]]:
        """The `state_dict` of each sequence (first axis) of one batch, as
        an Evaluator like this one would hold after that sequence alone:
        from one pass over the batch (one wait for a device). This
        Evaluator's own sums are cleared, before and after."""
        self._clear_sums()
        res = self._pass(logits, targets)
        table = self._table(res.n_cols)
        lead = res.lead_shape
        per = math.prod(lead[1:])
        states = []
        for b in range(lead[0] if lead else 1):
            at = slice(b * per, (b + 1) * per)
            part = res.derived(lead[1:], None if res.targets is None else res.targets[at], lambda a: a[at])
            part.set_counted(res.counted[at])
            part.n_counted = int(np.count_nonzero(part.counted))
            part.nll_sum = fsum(part.floats("nll"))
            self._take(part, table, False, None)
            states.append(self._state_now())
            self._clear_sums()
        return states

    def _drain(self) -> None:
        """Add the batch whose pass was launched on a device and not waited
        for (a wait for its own transfer only); the error its pass found is
        kept for `_settle`, and the batch is not added."""
        p = self._pending
        if p is None:
            return
        try:
            p.res.finish()
        except ValueError as e:  # (kept without the pass, nor its frames: they hold its logits)
            p.res.pending = None
            self._errors.append((p.update, _engine.let_go(e)))
        else:
            self._take(p.res, p.table, p.ref, p.docs)
        self._pending = None

    def _settle(self) -> None:
        """Before a read of the sums: the batches not yet added added
        (`_drain`), and the first error their passes found raised, naming
        its update."""
        self._drain()
        if self._errors:
            (k, first), more = self._errors[0], len(self._errors) - 1
            self._errors = []
            also = f"; {more} later update(s) failed too and were not added" if more else ""
            raise ValueError(f"update {k} of this Evaluator since it was made or reset (its logits, on a CUDA "
                             f"device, are checked when the sums are read; that batch was not added{also}): "
                             f"{first}") from first

    @_one_at_a_time
    def __getstate__(self) -> Dict[str, Any]:
        """For pickle and copy.deepcopy: the batch not yet added is added
        first (its results are on the device until then), once, whichever
        thread adds it (an update meanwhile waits)."""
        self._drain()
        state = self.__dict__.copy()
        # (errors kept for the next read as plain ValueErrors: a RowError's
        # own arguments are not its message, which unpickling would pass)
        state["_errors"] = [(k, ValueError(str(e))) for k, e in self._errors]
        del state["_lock"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_lock()

    def _new_lock(self) -> None:
        """A lock of its own (`_one_at_a_time`), known to `_free_locks_after_fork`."""
        self._lock = threading.RLock()
        _EVALUATORS.add(self)

    def _document_rows(self, document_ids: Any, targets: Any) -> Optional[I64Array]:
        """document_ids checked against the targets and this Evaluator's
        batches so far, flattened (shifted with the targets)."""
        own, own_docs = self._own_sums()[:2]
        seen = own.tokens + own.ignored > 0
        with_docs = own_docs is not None
        if document_ids is None:
            if with_docs:
                raise ValueError("this Evaluator's batches have document_ids: give them for every batch")
            return None
        if seen and not with_docs:
            raise ValueError("document_ids for some batches only: this Evaluator's earlier batches had none")
        doc = _ids_per_position(as_index_array(document_ids, "document_ids"),
                                tuple(int(n) for n in getattr(targets, "shape", np.shape(targets))))
        if self.shift:
            doc = doc[..., 1:]
        if doc.dtype.kind == "u" and doc.size and int(doc.max()) > np.iinfo(np.int64).max:
            raise ValueError("document_ids must fit in int64")
        return doc.reshape(-1).astype(np.int64)

    @np.errstate(over="ignore")  # squares past float64's range are inf, as their sums
    def _add(self, st: _Sums, res: _engine.RowResults, table: Optional[I64Array], ref: bool,
             docs: Optional[I64Array], doc_sums: Optional[DocumentSums]) -> None:
        n = res.n_counted
        nll = res.floats("nll")  # 0 where not counted, as entropy and KL
        st.tokens += n
        st.ignored += nll.size - n
        st.nll_sum += res.nll_sum
        st.nll_sq += float(np.dot(nll, nll))
        counted = res.counted
        per_doc: Dict[str, F64Array] = {}
        if docs is not None:
            per_doc["tokens"] = counted.astype(np.float64)
            per_doc["nll_sum"] = nll
        if table is not None:
            units = units_of(res, table)
            with_units = np.where(units > 0, nll, 0.0)
            b = units.astype(np.float64)
            st.bytes += int(units.sum())
            st.nll_sum_bytes += float(np.sum(with_units))
            st.nll_sq_bytes += float(np.dot(with_units, with_units))
            st.nll_bytes_product += float(np.dot(with_units, b))  # (nll * 0 is NaN for an inf nll)
            st.bytes_sq += float(np.dot(b, b))
            per_doc["bytes"], per_doc["nll_sum_bytes"] = b, with_units
        if not self.nll_only:
            correct = counted & (res.indices("argmax") == res.target_ids)
            entropy = res.floats("entropy")
            st.correct += int(np.count_nonzero(correct))
            st.entropy_sum += float(np.sum(entropy))
            st.entropy_sq += float(np.dot(entropy, entropy))
            per_doc["correct"], per_doc["entropy_sum"] = correct.astype(np.float64), entropy
        if ref:
            kl, ref_nll = res.floats("kl"), res.floats("ref_nll")
            with np.errstate(invalid="ignore"):  # inf - inf: both models rule the target out
                diff = np.where(counted, nll - ref_nll, 0.0)
            diff[np.isnan(diff)] = np.inf  # a sum of squares never holds NaN (state_dict refuses it)
            st.kl_tokens += n
            st.kl_sum += float(np.sum(kl))
            st.kl_sq += float(np.dot(kl, kl))
            st.same_top += int(np.count_nonzero(counted & (res.indices("argmax") == res.indices("ref_argmax"))))
            st.nll_sum_paired += res.nll_sum
            st.ref_nll_sum += float(np.sum(np.where(counted, ref_nll, 0.0)))
            st.diff_sq += float(np.dot(diff, diff))
            per_doc["kl_tokens"], per_doc["kl_sum"] = counted.astype(np.float64), kl
        if docs is not None and doc_sums is not None:
            doc_sums.add_rows(docs[counted], {k: v[counted] for k, v in per_doc.items()})

    @_one_at_a_time
    def compute(self) -> Metrics:
        """The metrics of everything seen so far.

        Returns
        -------
        Metrics
            As `evaluate` would give over every batch at once.
        """
        self._settle()
        st = self._state
        n = st.tokens
        loss = st.nll_sum / n if n else math.nan
        has_bytes = self._token_bytes_in is not None
        full = not self.nll_only
        kn = st.kl_tokens
        se: Dict[str, float] = StandardErrors(loss=mean_stderr(st.nll_sum, st.nll_sq, n))
        se["bits_per_token"] = se["loss"] / LN2
        if has_bytes:
            se["bits_per_byte"] = ratio_stderr(st.nll_sum_bytes, float(st.bytes), st.nll_sq_bytes,
                                               st.nll_bytes_product, st.bytes_sq, n) / LN2
        if full:
            se["accuracy"] = mean_stderr(st.correct, st.correct, n)
            se["entropy"] = mean_stderr(st.entropy_sum, st.entropy_sq, n)
        if kn:
            se["kl"] = mean_stderr(st.kl_sum, st.kl_sq, kn)
            se["same_top"] = mean_stderr(st.same_top, st.same_top, kn)
            se["loss_diff"] = mean_stderr(st.nll_sum_paired - st.ref_nll_sum, st.diff_sq, kn)
        values: Dict[str, Any] = dict(
            tokens=n, ignored=st.ignored, bytes=st.bytes if has_bytes else None,
            nll_sum=st.nll_sum, loss=loss, perplexity=exp(loss) if n else math.nan,
            bits_per_token=loss / LN2, bits_per_byte=self.bits_per_byte() if has_bytes else None,
            accuracy=st.correct / n if n and full else math.nan,
            entropy=st.entropy_sum / n if n and full else math.nan,
            kl=st.kl_sum / kn if kn else None,
            same_top=st.same_top / kn if kn else None,
            loss_ref=st.ref_nll_sum / kn if kn else None,
            loss_diff=(st.nll_sum_paired - st.ref_nll_sum) / kn if kn else None,
            perplexity_interval=_exp_interval(loss, se["loss"]) if n else None)
        if self._docs is not None:
            values.update(self._document_values(self._docs, values, se, has_bytes, full))
        if self._ranks is not None:
            values.update(self._ranks.values(n, se))
        if self._cal is not None:  # (the bins' arrays copied: changing the result's leaves the sums as they are)
            cal = self._cal
            values.update(ece=cal.ece, calibration=Calibration(cal.edges.copy(), cal.counts.copy(),
                                                               cal.conf_sum.copy(), cal.correct.copy()))
        return Metrics(stderr=se, **values)

    def _document_values(self, docs: DocumentSums, micro: Mapping[str, Any], se: Dict[str, float],
                         has_bytes: bool, full: bool) -> Dict[str, Any]:
        """The macro means (and their standard errors, into ``se``), the
        clustered standard errors and the per-document values."""
        per = Documents.from_sums(docs, has_bytes=has_bytes, full=full, has_kl=micro["kl"] is not None)
        tokens = docs.column("tokens")
        out: Dict[str, Any] = {"documents": int(np.count_nonzero(tokens)), "per_document": per}
        means = {"loss": per.loss, "bits_per_byte": per.bits_per_byte, "accuracy": per.accuracy,
                 "entropy": per.entropy, "kl": per.kl}
        for name, v in means.items():
            if v is None:
                continue
            v = v[~np.isnan(v)]
            out["macro_" + name] = float(np.mean(v)) if v.size else math.nan
            se["macro_" + name] = sample_stderr(v)
        out["macro_bits_per_token"] = out["macro_loss"] / LN2
        se["macro_bits_per_token"] = se["macro_loss"] / LN2
        out["macro_perplexity"] = exp(out["macro_loss"]) if tokens.size else math.nan
        with np.errstate(over="ignore"):  # a document's perplexity past float64 is inf, as is then the mean
            ppl = np.exp(per.loss)
        out["mean_perplexity"] = sample_mean(ppl)
        se["mean_perplexity"] = sample_stderr(ppl)
        clustered: Dict[str, float] = DocumentStandardErrors(loss=clustered_stderr(docs.column("nll_sum"), tokens))
        clustered["bits_per_token"] = clustered["loss"] / LN2
        if has_bytes:
            clustered["bits_per_byte"] = clustered_stderr(docs.column("nll_sum_bytes"), docs.column("bytes")) / LN2
        if full:
            clustered["accuracy"] = clustered_stderr(docs.column("correct"), tokens)
            clustered["entropy"] = clustered_stderr(docs.column("entropy_sum"), tokens)
        if micro["kl"] is not None:
            clustered["kl"] = clustered_stderr(docs.column("kl_sum"), docs.column("kl_tokens"))
        out["stderr_documents"] = clustered
        if micro["tokens"]:
            out["perplexity_interval_documents"] = _exp_interval(micro["loss"], clustered["loss"])
        return out

    @_one_at_a_time
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
        self._settle()
        return bits_per_unit(self._state.nll_sum_bytes, self._state.bytes)

    def _check_compatible(self, other: Evaluator) -> None:
        if not isinstance(other, Evaluator):
            raise TypeError(f"can only merge another Evaluator, got {type(other).__name__}")
        if other is self:  # (a loop `total.merge(e) for e in evaluators` that holds total: it would count twice)
            raise ValueError("cannot merge an Evaluator into itself: its sums would count twice; merge the "
                             "other Evaluators only, or a copy (copy.deepcopy) to count them twice")
        if (other.ignore_index, other.softcap) != (self.ignore_index, self.softcap):
            raise ValueError("cannot merge Evaluators with different ignore_index or softcap")
        if other.nll_only != self.nll_only:
            raise ValueError("cannot merge an nll_only Evaluator and one computing every metric")
        if (other.top_k, other.calibration_bins) != (self.top_k, self.calibration_bins):
            raise ValueError("cannot merge Evaluators with different top_k or calibration_bins")
        if (other._token_bytes_in is None) != (self._token_bytes_in is None):
            raise ValueError("cannot merge an Evaluator with token_bytes and one without")
        if self._token_bytes_in is not None and not _same_table(self._token_bytes_in, other._token_bytes_in):
            raise ValueError("cannot merge Evaluators with different token_bytes tables")

    def merge(self, other: Evaluator) -> Evaluator:
        """Add another Evaluator's sums to this one (e.g. from another worker).

        After `all_reduce`, they are added to this rank's own sums, as an
        `update`'s batch; ``other``'s are those its `compute` reports.

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
            When ``other`` is this Evaluator itself, or has other settings:
            another ``ignore_index``, ``softcap``, ``nll_only``, ``top_k``,
            ``calibration_bins`` or ``token_bytes`` table, batches
            without ``document_ids`` where this one's have them (or the
            reverse), or batches of another vocabulary size.
        TypeError
            When ``other`` is not an Evaluator.
        """
        self._check_compatible(other)
        with both_held(self._lock, other._lock):
            return self._merge(other)

    def _merge(self, other: Evaluator) -> Evaluator:
        self._settle()
        other._settle()
        if other._vocab is not None:  # (once both have their batches on a device added)
            _check_same_vocab(self._vocab, other._vocab, "the other Evaluator's batches had", "merge")
        own, own_docs, own_ranks, own_cal = self._own_sums()
        docs = _merged_documents((own, own_docs), (other._state, other._docs))
        mine, theirs = asdict(own), asdict(other._state)
        ranks = own_ranks if own_ranks is None or other._ranks is None else own_ranks.add(other._ranks)
        cal = own_cal if own_cal is None or other._cal is None else own_cal.add(other._cal)
        self._state = _sums({k: v + theirs[k] for k, v in mine.items()})
        self._docs, self._ranks, self._cal, self._own = docs, ranks, cal, None
        self._vocab = self._vocab if self._vocab is not None else other._vocab
        return self

    @_one_at_a_time
    def state_dict(self) -> Dict[str, Any]:
        """The sums as a dict of Python numbers (picklable, JSON-ready).

        Returns
        -------
        dict
            Counts (int) and float64 sums (float), and with ``document_ids``
            a ``"documents"`` entry (the ids and each document's sums, as
            lists); a ``"settings"`` entry (integers: the settings the sums
            were made with, which `load_state_dict` compares). `load_state_dict`
            takes it.
        """
        self._settle()
        state = self._state_now()
        state["settings"] = self._settings_state()
        return state

    def _settings_state(self) -> Dict[str, int]:
        """The settings `merge` compares, each as an integer (a digest for
        a tuple or a table): a state_dict's ``"settings"``."""
        return {k: v[0] for k, v in self._settings().items() if k != "document_ids"}

    def _state_now(self) -> Dict[str, Any]:
        """`state_dict` of the sums as they are (a batch not yet added left out)."""
        state: Dict[str, Any] = asdict(self._state)
        if self._docs is not None:
            state["documents"] = self._docs.state()
        if self._ranks is not None:
            state["rank"] = self._ranks.state()
        if self._cal is not None:
            state["calibration"] = _calibration_state(self._cal)
        return state

    @_one_at_a_time
    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the sums by those of `state_dict` (batches on a CUDA device not
        yet added are dropped with the rest).

        Parameters
        ----------
        state : mapping
            A `state_dict` (of this Evaluator or another one).

        Raises
        ------
        ValueError
            A state that no `state_dict` of an Evaluator with these
            settings gives: a missing or unknown key; negative, fractional
            or non-numeric counts or sums; fractional or repeated document
            ids or lists of unequal lengths; documents, ranks or calibration
            bins that do not add up to the totals; byte sums without
            ``token_bytes``, accuracy or entropy sums with ``nll_only``,
            another ``top_k`` or ``calibration_bins``; a state made with
            other settings (its ``"settings"``: ``ignore_index``,
            ``softcap``, ``nll_only``, ``top_k``, ``calibration_bins``, the
            ``token_bytes`` table). Nothing changes then.
        """
        names = set(_COUNTS + _SUMS)
        missing = names - set(state)
        unknown = set(state) - names - {"documents", "settings"}
        if "settings" in state:  # (a state of an older version has none: its values are checked below)
            made, mine = state["settings"], self._settings_state()
            if not isinstance(made, Mapping) or set(made) != set(mine):
                raise ValueError(f"Evaluator state: settings must hold {sorted(mine)}, got {made!r}")
            other = [k for k in mine if made[k] != mine[k]]
            if other:
                raise ValueError(f"Evaluator state: made with another {', '.join(other)} than this Evaluator's; "
                                 f"load it into an Evaluator made with the settings of the one that saved it")
        if self.top_k:
            missing |= {"rank"} - set(state)
        if self.calibration_bins is not None:
            missing |= {"calibration"} - set(state)
        unknown -= ({"rank"} if self.top_k else set()) | ({"calibration"} if self._cal is not None else set())
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
        st = _sums(new)
        docs = DocumentSums.from_state(state["documents"]) if "documents" in state else None
        ranks = _RankSums.from_state(self.top_k, state["rank"]) if self.top_k else None
        cal = self._cal
        if cal is not None:
            c = state["calibration"]
            if not isinstance(c, Mapping) or set(c) != {"counts", "conf_sum", "correct"}:
                raise ValueError("Evaluator state: calibration must hold counts, conf_sum and correct")
            cal = _calibration_from(cal, c["counts"], c["conf_sum"], c["correct"])
        problem = self._state_problem(st, docs, ranks, cal)
        if problem:
            raise ValueError(f"Evaluator state: {problem} (not a state_dict of an Evaluator like this one)")
        self._state = st
        self._docs, self._ranks, self._cal, self._own = docs, ranks, cal, None
        self._pending, self._errors = None, []  # (replaced with the rest: a batch on a device not yet added)
        self._vocab = None  # (a state does not say its vocabulary)

    def _state_problem(self, st: _Sums, docs: Optional[DocumentSums], ranks: Optional[_RankSums],
                       cal: Optional[Calibration]) -> Optional[str]:
        """What makes a state (its values each of the right type and sign)
        one that no Evaluator with these settings holds: sums where there is
        nothing to sum, a part above its whole, documents, ranks or bins
        that do not add up to the totals; None when there is nothing."""
        zero = {"no token is counted": (not st.tokens, [f for f in _COUNTS + _SUMS if f != "ignored"]),
                "this Evaluator has no token_bytes": (self._token_bytes_in is None, list(_BYTE_FIELDS)),
                "this Evaluator is nll_only": (self.nll_only, ["correct", "entropy_sum", "entropy_sq"]),
                "kl_tokens is 0": (not st.kl_tokens, list(_REF_FIELDS))}
        for why, (applies, names) in zero.items():
            nonzero = [k for k in names if getattr(st, k)] if applies else []
            if nonzero:
                return f"{nonzero[0]} is {getattr(st, nonzero[0])} but {why}"
        for part, whole in _PARTS:
            if not _at_most(getattr(st, part), getattr(st, whole)):
                return f"{part} ({getattr(st, part)}) exceeds {whole} ({getattr(st, whole)})"
        if ranks is not None:
            if any(h > st.tokens for h in ranks.hits) or ranks.hits != sorted(ranks.hits):
                return f"rank hits {ranks.hits} must grow with k and not exceed tokens ({st.tokens})"
            if not (_at_most(ranks.rr_sum, st.tokens) and _at_most(ranks.rr_sq, ranks.rr_sum)):
                return "the reciprocal ranks' sums exceed what tokens allow (each is in (0, 1])"
        if cal is not None:
            if cal.total != st.tokens or (not self.nll_only and int(cal.correct.sum()) != st.correct):
                return (f"the calibration bins hold {cal.total} tokens ({int(cal.correct.sum())} correct), "
                        f"the state {st.tokens} ({st.correct} correct)")
            lo, hi = cal.edges[:-1] * cal.counts, cal.edges[1:] * cal.counts
            outside = ~((cal.conf_sum >= lo * (1 - _REL) - _ABS) & (cal.conf_sum <= hi * (1 + _REL) + _ABS))
            if outside.any():
                return f"bin {int(np.argmax(outside))}'s summed confidence lies outside its edges"
        if docs is not None:
            for name in COLUMNS:
                total = float(np.sum(docs.column(name)))
                mine = getattr(st, name)
                if not (total == mine if name in _COUNTS else math.isclose(total, mine, rel_tol=_REL,
                                                                            abs_tol=_ABS)):
                    return f"the documents' {name} add up to {total:g}, the state's is {mine:g}"
        return None

    @_one_at_a_time
    def all_reduce(self, group: Any = None) -> Evaluator:
        """Sum the state across the ranks of ``torch.distributed``.

        Every rank ends with the global sums, and keeps its own: an `update`
        or `merge` after it adds to this rank's own sums (`compute` gives
        those then), and a later all_reduce sums them again, the batches
        added since included, never the global sums an earlier one gave
        (which would count each batch once per rank again). A no-op without torch or when torch.distributed is
        not initialized. The ranks' settings are compared first (a few int64
        numbers a rank); then the sums travel as one float64 tensor, on the
        current CUDA device for the nccl backend, on the CPU otherwise, and
        with ``document_ids`` each rank's documents are gathered.

        Parameters
        ----------
        group : torch.distributed process group, optional
            The group to reduce over (the default group when None).

        Returns
        -------
        Evaluator
            ``self``.

        Raises
        ------
        ValueError
            On every rank alike, before any sum moves, when the ranks'
            Evaluators differ in ``ignore_index``, ``softcap``, ``nll_only``,
            ``top_k``, ``calibration_bins`` or ``token_bytes`` (given or not,
            or another table), or when some ranks' batches had
            ``document_ids`` and others' had none (a rank without batches
            goes with either). The message names what differs on which rank.
            Likewise on every rank when an update's pass on a CUDA device
            failed on some rank (its error, raised at this read): that rank
            raises its own error, the others one naming it; nothing is
            summed, each rank's other batches are added, and a later
            all_reduce sums them.
        """
        return self._all_reduce(group)

    def _all_reduce(self, group: Any = None, failed: Optional[ValueError] = None, who: str = "Evaluator.all_reduce",
                    what: str = "summed (every rank raises; the batches that succeeded are added, and a later "
                                "all_reduce sums them)") -> Evaluator:
        """`all_reduce`, raising on every rank when some rank failed:
        ``failed``, this rank's error met before (`evaluate_bpb`'s), or one
        a batch not yet added raises now (the others' error: ``who: an
        update failed on rank r, so nothing was what: ...``)."""
        try:
            self._settle()  # (batches on a device not yet added: before the sums travel)
        except ValueError as e:  # raised on every rank alike, below (a rank alone in a collective hangs)
            failed = failed or e
        try:
            import torch
            import torch.distributed as dist
            ranks = dist.is_available() and dist.is_initialized()
        except ImportError:  # without torch there are no ranks to reduce over
            ranks = False
        if not ranks:
            if failed is not None:
                raise failed
            return self
        device: Union[str, torch.device] = "cpu"
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # first the settings, a fixed number of int64s from each rank: the sizes of what follows depend on them
        mine = self._settings()
        sent = torch.tensor([v for v, _ in mine.values()] + [int(failed is not None)], dtype=torch.int64,
                            device=device)
        parts = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, sent, group=group)
        table = [p.cpu().tolist() for p in parts]  # each rank's settings, the same list on every rank
        _raise_where_failed(failed, [row[-1] for row in table], group, who, what)  # (the last entry: a failed update)
        docs_by_rank = [row[list(mine).index("document_ids")] for row in table]
        differ = [name for i, name in enumerate(mine) if len({row[i] for row in table}) > 1
                  and (name != "document_ids" or {_WITH_DOCS, _WITHOUT_DOCS} <= set(docs_by_rank))]
        if differ:  # (every rank takes this branch: the same table says so)
            raise ValueError("Evaluator.all_reduce: the ranks' Evaluators differ: "
                             + _differing({k: text for k, (_, text) in mine.items()}, differ, group)
                             + ". Give every rank's Evaluator the same settings, and document_ids to every batch "
                             "on every rank or to none")
        own = own_state, docs, rank_sums, cal = self._own_sums()  # (never the sums of an earlier all_reduce)
        state = asdict(own_state)
        extra: List[float] = [] if rank_sums is None else rank_sums.flat()
        if cal is not None:
            extra += cal.counts.tolist() + cal.conf_sum.tolist() + cal.correct.tolist()
        vals = torch.tensor([float(v) for v in state.values()] + extra, dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
        values = vals.cpu().tolist()
        at = len(state)
        if rank_sums is not None:
            rank_sums = _RankSums.from_flat(self.top_k, values[at:at + len(self.top_k) + 2])
            at += len(self.top_k) + 2
        if cal is not None:
            b = cal.bins
            cal = _calibration_from(cal, values[at:at + b], values[at + b:at + 2 * b], values[at + 2 * b:at + 3 * b])
        if _WITH_DOCS in docs_by_rank:  # some rank has documents: every rank's are gathered and added
            gathered: List[Any] = [None] * len(table)
            dist.all_gather_object(gathered, None if docs is None else docs.state(), group=group)
            docs = DocumentSums()
            for part in gathered:
                if part is not None:
                    docs.add(DocumentSums.from_state(part))
        self._state = _sums(dict(zip(state, values[:len(state)])))
        self._docs, self._ranks, self._cal, self._own = docs, rank_sums, cal, own
        return self

    def _settings(self) -> Dict[str, Tuple[int, str]]:
        """What must agree across the ranks of an all-reduce, each as an
        int64 (a digest for a tuple or a table) and as text for an error:
        the settings merge checks, and whether the batches had document_ids
        (a rank without batches goes with either)."""
        if self._digest is None:
            self._digest = _table_digest(self._token_bytes_in)
        own, own_docs = self._own_sums()[:2]
        seen = own.tokens + own.ignored > 0 or own_docs is not None
        docs = _WITH_DOCS if own_docs is not None else _WITHOUT_DOCS if seen else 0
        return {"ignore_index": (self.ignore_index, str(self.ignore_index)),
                "softcap": (_float_bits(self.softcap), repr(self.softcap)),
                "nll_only": (int(self.nll_only), str(self.nll_only)),
                "top_k": (_digest(repr(self.top_k).encode()), str(self.top_k or None)),
                "calibration_bins": (self.calibration_bins or 0, str(self.calibration_bins)),
                "token_bytes": self._digest,
                "document_ids": (docs, ("given", "not given")[docs - 1] if docs else "no batch")}

    def __repr__(self) -> str:
        pending = ", updates_pending=1" if self._pending is not None else ""
        return f"Evaluator(tokens={self._state.tokens}, ignore_index={self.ignore_index}{pending})"


@dataclass
class _Pending:
    """A batch whose pass was launched on a device and not waited for."""

    update: int  # which update of its Evaluator (1, 2, ...)
    res: _engine.RowResults
    table: Optional[I64Array]
    ref: bool
    docs: Optional[I64Array]


def _exp_interval(loss: float, stderr: float) -> Tuple[float, float]:
    """The 95% interval of exp(loss) from the standard error of the loss
    (inf to inf when a token's NLL is: the mean is then surely inf)."""
    if loss == math.inf:
        return math.inf, math.inf
    lo, hi = interval(loss, stderr)
    return exp(lo), exp(hi)


def state_from_floats(values: Mapping[str, float]) -> Dict[str, Union[int, float]]:
    """An Evaluator state from sums carried as floats (counts rounded back
    to integers), e.g. after a float64 all-reduce."""
    return {k: int(round(v)) if k in _COUNTS else float(v) for k, v in values.items()}


#: fields that stay 0 without token_bytes, and without reference logits
_BYTE_FIELDS = ("bytes", "nll_sum_bytes", "nll_sq_bytes", "nll_bytes_product", "bytes_sq")
_REF_FIELDS = ("same_top", "kl_sum", "kl_sq", "nll_sum_paired", "ref_nll_sum", "diff_sq")
#: (part, whole): a sum over some of the tokens of another
_PARTS = (("correct", "tokens"), ("kl_tokens", "tokens"), ("same_top", "kl_tokens"),
          ("nll_sum_bytes", "nll_sum"), ("nll_sq_bytes", "nll_sq"), ("nll_sum_paired", "nll_sum"))
#: how far float64 sums of the same values added in another order may differ
_REL, _ABS = 1e-6, 1e-9


def _at_most(part: float, whole: float) -> bool:
    """part <= whole: exactly for counts (ints), up to the rounding of sums
    added in another order for float sums."""
    if isinstance(part, int) and isinstance(whole, int):
        return part <= whole
    return part <= whole + _REL * whole + _ABS


def _check_top_k(top_k: Union[None, int, Iterable[int]]) -> Tuple[int, ...]:
    """top_k as ascending distinct ints >= 1 (() for None)."""
    if top_k is None:
        return ()
    try:
        ks = [top_k] if isinstance(top_k, (int, np.integer)) else list(top_k)
    except TypeError:
        raise TypeError(f"top_k must be an int or a sequence of ints, got {top_k!r}") from None
    for k in ks:
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"top_k must be an int or a sequence of ints, got {top_k!r}")
        if k < 1:
            raise ValueError(f"top_k must be at least 1, got {k}")
    if not ks:
        raise ValueError("top_k is empty: give at least one k, or None")
    return tuple(sorted({int(k) for k in ks}))


def _nonneg_int(x: object) -> bool:
    return type(x) is not bool and isinstance(x, (int, np.integer)) and int(x) >= 0


class _RankSums:
    """With top_k: counted tokens whose rank is below each k, and the sum
    and sum of squares of the reciprocal ranks (float64)."""

    def __init__(self, ks: Tuple[int, ...], hits: Optional[List[int]] = None, rr_sum: float = 0.0,
                 rr_sq: float = 0.0) -> None:
        self.ks = ks
        self.hits = [0] * len(ks) if hits is None else hits
        self.rr_sum, self.rr_sq = rr_sum, rr_sq

    def plus(self, res: _engine.RowResults) -> _RankSums:
        rank = res.indices("rank")[res.counted]
        rr = 1.0 / (rank + 1.0)
        return _RankSums(self.ks, [h + int(np.count_nonzero(rank < k)) for h, k in zip(self.hits, self.ks)],
                         self.rr_sum + float(np.sum(rr)), self.rr_sq + float(np.dot(rr, rr)))

    def add(self, other: _RankSums) -> _RankSums:
        return _RankSums(self.ks, [a + b for a, b in zip(self.hits, other.hits)], self.rr_sum + other.rr_sum,
                         self.rr_sq + other.rr_sq)

    def values(self, n: int, se: Dict[str, float]) -> Dict[str, Any]:
        acc = {}
        for k, h in zip(self.ks, self.hits):
            acc[k] = h / n if n else math.nan
            se[f"top_{k}_accuracy"] = mean_stderr(h, h, n)
        se["mean_reciprocal_rank"] = mean_stderr(self.rr_sum, self.rr_sq, n)
        return {"top_k_accuracy": acc, "mean_reciprocal_rank": self.rr_sum / n if n else math.nan}

    def state(self) -> Dict[str, Any]:
        return {"k": list(self.ks), "hits": list(self.hits), "rr_sum": self.rr_sum, "rr_sq": self.rr_sq}

    def flat(self) -> List[float]:
        return [float(h) for h in self.hits] + [self.rr_sum, self.rr_sq]

    @classmethod
    def from_flat(cls, ks: Tuple[int, ...], v: List[float]) -> _RankSums:
        return cls(ks, [int(round(x)) for x in v[:len(ks)]], v[len(ks)], v[len(ks) + 1])

    @classmethod
    def from_state(cls, ks: Tuple[int, ...], state: Any) -> _RankSums:
        try:
            ok = (tuple(state["k"]) == ks and len(state["hits"]) == len(ks)
                  and all(_nonneg_int(h) for h in state["hits"])
                  and all(isinstance(state[x], numbers.Real) and state[x] >= 0 for x in ("rr_sum", "rr_sq")))
        except (TypeError, KeyError):
            ok = False
        if not ok:
            raise ValueError(f"Evaluator state: rank must hold k {list(ks)}, non-negative integer hits and sums")
        return cls(ks, [int(h) for h in state["hits"]], float(state["rr_sum"]), float(state["rr_sq"]))


#: an Evaluator's sums: the counts and float sums, the documents, the ranks, the calibration bins
_Held = Tuple[_Sums, Optional[DocumentSums], Optional[_RankSums], Optional[Calibration]]


def _calibration_state(cal: Calibration) -> Dict[str, Any]:
    return {"counts": cal.counts.tolist(), "conf_sum": cal.conf_sum.tolist(), "correct": cal.correct.tolist()}


def _calibration_from(empty: Calibration, counts: Any, conf_sum: Any, correct: Any) -> Calibration:
    try:
        c = np.asarray(counts, np.float64).reshape(-1)
        s = np.asarray(conf_sum, np.float64).reshape(-1)
        k = np.asarray(correct, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError("Evaluator state: calibration must hold numbers") from None
    if not (c.size == s.size == k.size == empty.bins) or np.isnan(s).any() or (c < 0).any() or (s < 0).any() \
            or (k < 0).any() or (k > c).any():
        raise ValueError(f"Evaluator state: calibration must hold {empty.bins} non-negative counts and sums a bin")
    if not (np.isfinite(c) & (c == np.rint(c)) & np.isfinite(k) & (k == np.rint(k))).all():
        raise ValueError("Evaluator state: calibration's counts and correct must be whole numbers")
    return Calibration(empty.edges, np.rint(c).astype(np.int64), s, np.rint(k).astype(np.int64))


def _check_same_vocab(seen: Optional[int], n_cols: int, what: str, how: str = "update") -> None:
    """A ValueError when an Evaluator whose batches had ``seen`` columns
    (None: no batch yet) is given ``n_cols``: one Evaluator sums one
    vocabulary's tokens."""
    if seen is not None and n_cols != seen:
        raise ValueError(f"Evaluator.{how}: {what} {n_cols} columns (the vocabulary), this Evaluator's batches "
                         f"had {seen}: one Evaluator scores one vocabulary. Give every batch the same vocabulary "
                         f"axis (slice or pad the logits to the model's size), or use one Evaluator per "
                         f"vocabulary (reset() starts over)")


def _merged_documents(a: Tuple[_Sums, Optional[DocumentSums]],
                      b: Tuple[_Sums, Optional[DocumentSums]]) -> Optional[DocumentSums]:
    """The documents of two Evaluators' sums (each its state and its
    documents) added; an error when one has document_ids and the other has
    seen batches without."""
    if a[1] is None and b[1] is None:
        return None
    for state, docs in (a, b):
        if docs is None and state.tokens + state.ignored:
            raise ValueError("cannot merge an Evaluator with document_ids and one whose batches had none")
    merged = DocumentSums() if a[1] is None else a[1].copy()
    if b[1] is not None:
        merged.add(b[1])
    return merged


_WITH_DOCS, _WITHOUT_DOCS = 1, 2  # a rank's batches in Evaluator._settings (0: none yet)


def _by_rank(texts: List[str]) -> str:
    """Each distinct text with the ranks that hold it: "a on ranks [0, 2], b on rank 1"."""
    ranks: Dict[str, List[int]] = {}
    for r, t in enumerate(texts):
        ranks.setdefault(t, []).append(r)
    return ", ".join(f"{t} on {_ranks_text(rs)}" for t, rs in ranks.items())


def _differing(said: Dict[str, str], names: Optional[List[str]], group: Any) -> str:
    """"name is a on ranks [0, 2], b on rank 1; ..." for the names (None:
    those whose texts differ between the ranks), from each rank's texts
    (said, gathered: every rank must call it)."""
    import torch.distributed as dist

    shown: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shown, said, group=group)
    names = [k for k in said if len({s[k] for s in shown}) > 1] if names is None else names
    return "; ".join(f"{k} is {_by_rank([s[k] for s in shown])}" for k in names)


def _raise_where_failed(failed: Optional[BaseException], flags: List[int], group: Any, who: str, what: str) -> None:
    """Every rank raises when an update failed on some rank (flags: each
    rank's, non-zero where it failed, the same list on every rank; failed:
    this rank's error, None where it has none), before its sums travel (a
    rank raising alone would leave the others waiting in a collective):
    that rank its own error, the others one naming it and its message
    (``who: an update failed on rank r, so nothing was what: rank r:
    ...``). Nothing when no rank failed."""
    failed_on = [r for r, f in enumerate(flags) if f]
    if not failed_on:
        return
    import torch.distributed as dist

    errors: List[Any] = [None] * len(flags)
    dist.all_gather_object(errors, None if failed is None else str(failed), group=group)
    if failed is not None:
        raise failed
    raise ValueError(f"{who}: an update failed on {_ranks_text(failed_on)}, so nothing was {what}: "
                     f"rank {failed_on[0]}: {errors[failed_on[0]]}")


def _ranks_text(ranks: List[int]) -> str:
    """"rank 3", "ranks [0, 2]", the first eight of many then "..."."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks [" + ", ".join(map(str, ranks[:8])) + (", ...]" if len(ranks) > 8 else "]")


def _digest(data: bytes) -> int:
    """A 64-bit digest as a signed int (an int64 on every rank alike)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _float_bits(x: Optional[float]) -> int:
    """A float (0.0 for None) as the int64 of its bits."""
    return int(np.float64(0.0 if x is None else x).view(np.int64))


def _table_digest(table: Any) -> Tuple[int, str]:
    """token_bytes as a digest of its counts (0 without) and as text."""
    if table is None:
        return 0, "None"
    try:
        a = as_index_array(table, "token_bytes")
    except (TypeError, ValueError):
        return -1, "not a table"  # refused at the first batch; no rank holds a sum yet
    d = _digest(repr(a.shape).encode() + a.astype(np.int64).tobytes())
    return d, f"a table of {a.size} counts (digest {d & (2**64 - 1):016x})"


def _same_table(a: Any, b: Any) -> bool:
    """Whether two token_bytes tables hold the same counts."""
    if a is b:
        return True
    x, y = as_index_array(a, "token_bytes"), as_index_array(b, "token_bytes")
    return x.shape == y.shape and bool(np.array_equal(x, y))


def evaluate(logits: Any, targets: Any, *, token_bytes: Any = None, reference_logits: Any = None,
             document_ids: Any = None, ignore_index: Optional[int] = -100, shift: Optional[bool] = None,
             softcap: Optional[float] = None, num_threads: Optional[int] = None,
             top_k: Union[None, int, Iterable[int]] = None, calibration_bins: Optional[int] = None) -> Metrics:
    """Every metric of `Metrics` from one read of the logits.

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
        special tokens (`lmmetrics.token_bytes` builds it from a
        tokenizer); one entry per column of the logits. Gives ``bytes`` and
        ``bits_per_byte``.
    reference_logits : array_like, torch.Tensor, model output or None, default None
        The reference model's logits (keyword-only, so that two buffers of the
        same shape cannot be swapped): the distribution P_ref the expectation
        is taken over. Same shape as ``logits``; the dtype may differ (a
        float32 base against bfloat16 or float16 logits), each read in its
        own dtype. Gives ``kl``, ``same_top``, ``loss_ref`` and ``loss_diff``.
    document_ids : array_like, torch.Tensor, int or None, default None
        Integer document ids: shaped like ``targets``, one per position
        (shifted with them under ``shift=True``); for targets (B, T, ...),
        shaped (B,), one per sequence; or one int for every position. No
        other shape is taken: a (T,) row is never broadcast over the
        sequences, even when B == T (it is one id per sequence then). Gives
        the ``macro_*`` means (the mean over documents of each document's
        mean), ``mean_perplexity``, the standard errors clustered by
        document (``stderr_documents``) and ``per_document``.
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
    top_k : int, sequence of int or None, default None
        Also each target's rank, in the same pass: ``top_k_accuracy`` for
        each k and ``mean_reciprocal_rank`` (see `Evaluator`).
    calibration_bins : int or None, default None
        Also ``ece`` and ``calibration`` over this many confidence bins (at
        most 100,000).

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
    loss            0.458145 ± 0.24 (se, tokens)
    perplexity      1.58114 [0.997553, 2.50613] (95%, tokens)
    bits_per_token  0.660964 ± 0.34 (se, tokens)
    bits_per_byte   0.330482 ± 0.33 (se, tokens)
    accuracy        1 ± 0 (se, tokens)
    entropy         0.839376 ± 0.2 (se, tokens)
    >>> m.stderr["loss"]            # the sample standard deviation of the NLL over sqrt(2)
    0.2350...
    """
    ev = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index, shift=shift, softcap=softcap,
                   num_threads=num_threads, top_k=top_k, calibration_bins=calibration_bins)
    ev._update_rows(logits, targets, reference_logits=reference_logits, document_ids=document_ids)
    return ev.compute()


def evaluate_bpb(model: Callable[[Any], Any], batches: Iterable[Tuple[Any, Any]], steps: int,
                 token_bytes: Any, *, softcap: Optional[float] = None) -> float:
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
        How many batches to read, at least 1.
    token_bytes : array_like or torch.Tensor
        ``token_bytes[v]`` is the byte length of token ``v``; 0 for special
        tokens, which leave both sums.
    softcap : float or None, default None
        For a ``model`` that returns the head's raw logits: apply
        nanochat's ``softcap * tanh(logits / softcap)`` to them first, in
        float32 for 16- and 32-bit logits as nanochat does after
        ``logits.float()`` (float64 logits in float64). None: the logits are
        read as they come (nanochat's ``GPT.forward`` already caps them).

    Returns
    -------
    float
        ``sum NLL / (ln 2 * sum bytes)``; inf when no byte was counted.

    Raises
    ------
    ValueError
        ``steps`` not a positive integer, ``batches`` holding fewer than
        ``steps`` batches, or as for `lmmetrics.bits_per_byte`. Across
        ranks, a batch that ran out or failed on some rank raises on every
        rank, at the all-reduce (that rank its own error, the others one
        naming it): that rank still calls ``model`` for its other batches,
        and no rank is left waiting or sums another evaluation's batches.

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

    if not isinstance(steps, bool) and hasattr(steps, "__index__"):  # (a 0-d integer tensor or array)
        steps = operator.index(steps)
    steps = check_positive_int("steps", steps)  # (range(-1) would read nothing and give inf)
    ev = Evaluator(token_bytes=token_bytes, ignore_index=-1, nll_only=True, shift=False,  # y is aligned with x
                   softcap=softcap)
    # across ranks, an error on one rank is raised on every rank, at the all-reduce: that rank reads its
    # batches on (to meet the collectives a sharded model's forward holds), adding none, and the others
    # do not sum without it (a rank raising alone left them waiting, or summing its next evaluation's)
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    failed: Optional[ValueError] = None
    it = iter(batches)
    with torch.no_grad():
        for step in range(steps):
            try:
                x, y = next(it)
            except StopIteration:  # (a bare StopIteration ends a caller's generator, or reads as its end)
                failed = failed or ValueError(f"evaluate_bpb: batches ran out after {step} of steps={steps}")
                break
            out = model(x)
            if failed is None:
                try:
                    ev.update(out, y)
                except ValueError as e:
                    failed = e
            if failed is not None and not ranks:
                break
    if ranks:
        ev._all_reduce(failed=failed, who="evaluate_bpb", what="summed (every rank raises)")
    elif failed is not None:
        raise failed
    return ev.bits_per_byte()
