"""What a pass computes and what it returns: the one list of per-row
outputs (`OUTPUTS`), `RowResults` (numpy, float64 / int64, one
value a row), and `allocate`, which checks two buffers and the targets
against each other and allocates a pass's outputs. Every backend fills a
RowResults; none imports the engine."""
from __future__ import annotations

import math
from operator import attrgetter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Literal, Mapping, Optional, Tuple, TypeVar

import numpy as np
import numpy.typing as npt

from .inputs import DescribedLogits, as_targets
from .types import BoolArray, F64Array, I64Array

if TYPE_CHECKING:
    import torch

#: every per-row output a pass can compute, in one order (the native core's
#: outputs tuple takes them in this order, the GPU result buffer's rows
#: follow it), with its dtype: the one list a new output joins (with its
#: field of RowResults, which a test holds to this list)
#: (rank: the number of logits above the target's, plus those equal to it
#: at a lower index (0 exactly at the first argmax); top_logprob: the top
#: token's log-probability, max - logsumexp)
_OUTPUT_DTYPES: Tuple[Tuple[str, type], ...] = (
    ("nll", np.float64), ("entropy", np.float64), ("argmax", np.int64), ("kl", np.float64),
    ("ref_argmax", np.int64), ("ref_nll", np.float64), ("rank", np.int64), ("top_logprob", np.float64))
OUTPUTS: Tuple[str, ...] = tuple(name for name, _ in _OUTPUT_DTYPES)
#: the integer ones (-1 where a row is not counted; the others 0)
INDEX_OUTPUTS: Tuple[str, ...] = tuple(name for name, dtype in _OUTPUT_DTYPES if dtype is np.int64)
#: the outputs of the reference logits, computed when there are some and
#: the output named beside them is asked for (never asked for by name)
_OF_REFERENCE = {"ref_argmax": "argmax", "ref_nll": "ref_nll"}
#: the names a pass is asked for (``run(nll=True, ...)``)
REQUESTS: Tuple[str, ...] = tuple(name for name in OUTPUTS if name != "ref_argmax")
#: a RowResults' outputs as a tuple in OUTPUTS' order (None where not computed)
outputs_of = attrgetter(*OUTPUTS)

#: the float64 per-row outputs of a pass, and the int64 ones (for the
#: typed accessors; a test holds them to OUTPUTS)
FloatOutput = Literal["nll", "entropy", "kl", "ref_nll", "top_logprob"]
IndexOutput = Literal["argmax", "ref_argmax", "rank"]

#: what a pass computes: names of REQUESTS (the one object carried from
#: ``run`` through ``allocate`` and the lazy-logits loop)
Want = FrozenSet[str]


def want_of(requests: Mapping[str, bool]) -> Want:
    """The Want of ``run``'s keyword requests (``{"nll": True, "rank": False}``...):
    TypeError for a name that is no request."""
    key = tuple(requests.items())
    try:
        return _WANTS[key]  # (a few patterns of requests recur: the calls' fixed cost)
    except KeyError:
        pass
    unknown = sorted(set(requests) - set(REQUESTS))
    if unknown:
        raise TypeError(f"unknown output(s) {', '.join(unknown)}; a pass computes {', '.join(REQUESTS)}")
    want = _WANTS[key] = frozenset(name for name, on in requests.items() if on)
    return want


_WANTS: Dict[Tuple[Tuple[str, bool], ...], Want] = {}
#: per output: its name, dtype, the request that asks for it, and whether
#: it is the reference's (allocated only where there is a reference)
_ALLOCATED = tuple((name, dtype, _OF_REFERENCE.get(name, name), name in _OF_REFERENCE)
                   for name, dtype in _OUTPUT_DTYPES)


@dataclass
class RowResults:
    """Per-row outputs of one pass (numpy, float64 / int64, flattened rows).

    An output is None when the pass did not compute it (``run``'s flags say
    which are); the CUDA path fills the ones that are not None in place.
    Consumers read them with `floats`, `indices` and
    `target_ids`, which hold the arrays' types and say so when a
    pass lacks what they need."""

    lead_shape: Tuple[int, ...]    # the logits shape without the vocabulary axis
    n_cols: int                    # vocabulary size
    dtype: str                     # logits dtype name
    device: Optional[torch.device]  # None for numpy input, else the torch device
    targets: Optional[I64Array]    # int64, flattened; None without targets
    ignore_index: int
    n_counted: int = 0             # rows counted
    nll_sum: float = 0.0           # sum of nll over counted rows (when nll is computed)
    nll: Optional[F64Array] = None
    entropy: Optional[F64Array] = None
    argmax: Optional[I64Array] = None
    kl: Optional[F64Array] = None
    ref_argmax: Optional[I64Array] = None
    ref_nll: Optional[F64Array] = None
    rank: Optional[I64Array] = None
    top_logprob: Optional[F64Array] = None
    _counted: Optional[BoolArray] = field(default=None, init=False, repr=False)
    #: what completes a pass launched on a device and not waited for, given
    #: these results to fill (None once they are here; not holding them: a
    #: pass dropped unread frees at once): `finish`
    pending: Optional[Callable[[RowResults], None]] = field(default=None, init=False, repr=False)
    #: a pass launched on a device and not waited for: its result buffer
    #: there (`lmmetrics._engine.cuda.layout`), kept with the results
    on_device: Any = field(default=None, init=False, repr=False)

    def finish(self) -> RowResults:
        """The results, once the pass that computes them has completed (a
        pass on a device launched without waiting for it completes here:
        its one transfer, and its errors, naming the first bad row). One
        that does not complete (an error, or an interrupt during the wait)
        is done again at the next call: the results are never left half
        filled."""
        pending = self.pending
        if pending is not None:
            pending(self)
            self.pending = None
        return self

    @property
    def counted(self) -> BoolArray:
        """bool mask of the counted rows (targets neither negative nor ignore_index)"""
        if self._counted is None:
            t = self.targets
            self._counted = (np.ones(math.prod(self.lead_shape), bool) if t is None
                             else (t >= 0) & (t != self.ignore_index))
        return self._counted

    def set_counted(self, counted: BoolArray) -> None:
        """The counted rows as a pass found them (targets read on a device)."""
        self._counted = counted

    def floats(self, name: FloatOutput) -> F64Array:
        """The float64 output ``name`` (the pass must have computed it)."""
        values: Optional[F64Array] = getattr(self, name)
        return _computed(values, name)

    def indices(self, name: IndexOutput) -> I64Array:
        """The int64 output ``name`` (the pass must have computed it)."""
        values: Optional[I64Array] = getattr(self, name)
        return _computed(values, name)

    @property
    def target_ids(self) -> I64Array:
        """The flattened int64 targets (the pass must have had targets)."""
        return _computed(self.targets, "targets")

    def derived(self, lead_shape: Tuple[int, ...], targets: Optional[I64Array],
                each: Callable[[Any], Any]) -> RowResults:
        """Results of the same pass over other rows: these settings, the given
        targets, and ``each(array)`` for each output this pass computes
        (views of some rows, or new arrays for them)."""
        new = replace(self, lead_shape=lead_shape, targets=targets)
        for name in OUTPUTS:
            values = getattr(self, name)
            setattr(new, name, None if values is None else each(values))
        return new


_A = TypeVar("_A", bound=npt.NDArray[Any])


def _computed(values: Optional[_A], name: str) -> _A:
    if values is None:
        raise RuntimeError(f"lmmetrics: internal error: {name} is not computed by this pass")
    return values


def allocate(lg: DescribedLogits, ref: Optional[DescribedLogits], targets: Any, ignore: int, *,
             check_range: bool, want: Want, targets_later: bool = False) -> RowResults:
    """The checks of both buffers and the targets against each other, and
    the outputs of a pass over them, allocated (not yet computed).
    targets_later: the targets are not looked at here (the pass reads them
    where they are, and fills out's targets: the CUDA path)."""
    if ref is not None and ref.lead_shape + (ref.n_cols,) != lg.lead_shape + (lg.n_cols,):
        raise ValueError(
            f"reference_logits shape {ref.lead_shape + (ref.n_cols,)} does not match "
            f"logits shape {lg.lead_shape + (lg.n_cols,)}")
    if targets is not None and targets_later and lg.n_rows:
        tgt = None
    elif targets is not None:
        tgt = as_targets(targets, lg, check_range=check_range, ignore_index=ignore)
    elif "nll" in want or "ref_nll" in want:
        raise ValueError("targets are required for the NLL")
    elif "rank" in want:
        raise ValueError("targets are required for the rank")
    else:
        tgt = None
    n = lg.n_rows
    out = RowResults(lg.lead_shape, lg.n_cols, lg.dtype, _device(lg.keep), tgt, ignore, n_counted=n)
    for name, dtype, asked, of_reference in _ALLOCATED:
        if asked in want and (ref is not None or not of_reference):
            setattr(out, name, np.empty(n, dtype))
    return out


def fsum(values: npt.NDArray[np.float64]) -> float:
    """The correctly rounded sum of non-negative values (NLL): inf where it
    overflows (math.fsum raises there)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def _device(x: Any) -> Optional[torch.device]:
    return x.device if hasattr(x, "device") and not isinstance(x, np.ndarray) else None
