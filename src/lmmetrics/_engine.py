"""The one path from the public functions to a computation.

Every metric calls :func:`run`, which takes model outputs' ``.logits``,
aligns unshifted inputs (``shift=True``), validates arguments with the GIL
held, allocates the per-row float64 outputs, calls the native core once (GIL
released, OpenMP inside; a bounded chunk of rows at a time when the logits
and the reference logits differ in dtype) and raises a clear exception for
bad rows. CUDA tensors take the same path up to the computation, which torch
does on their device (:mod:`lmmetrics._cuda`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Tuple, TypeVar

import numpy as np
import numpy.typing as npt

from . import _core
from ._checks import MAX_THREADS as MAX_THREADS
from ._checks import SOFTCAP_RANGE as SOFTCAP_RANGE
from ._checks import check_ignore_index as check_ignore_index
from ._checks import check_positive_int as check_positive_int
from ._checks import check_shift as check_shift
from ._checks import check_softcap as check_softcap
from ._checks import check_threads as check_threads
from ._errors import ROW_STATUSES, RowError, Status, row_error, target_error
from ._inputs import (DescribedLogits, Logits, as_logits, as_targets, is_cuda, is_torch, model_logits, row_blocks,
                      shifted)
from ._lazy import DEFAULT_CHUNK_BYTES, Projected
from ._types import BoolArray, F64Array, I64Array

if TYPE_CHECKING:
    import torch

#: the float64 per-row outputs of a pass, and the int64 ones
FloatOutput = Literal["nll", "entropy", "kl", "ref_nll"]
IndexOutput = Literal["argmax", "ref_argmax"]


@dataclass
class RowResults:
    """Per-row outputs of one pass (numpy, float64 / int64, flattened rows).

    An output is None when the pass did not compute it (``run``'s flags say
    which are); the CUDA path fills the ones that are not None in place.
    Consumers read them with :meth:`floats`, :meth:`indices` and
    :attr:`target_ids`, which hold the arrays' types and say so when a
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
    _counted: Optional[BoolArray] = field(default=None, init=False, repr=False)

    @property
    def counted(self) -> BoolArray:
        """bool mask of the counted rows (targets neither negative nor ignore_index)"""
        if self._counted is None:
            t = self.targets
            self._counted = (np.ones(math.prod(self.lead_shape), bool) if t is None
                             else (t >= 0) & (t != self.ignore_index))
        return self._counted

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


_A = TypeVar("_A", bound=npt.NDArray[Any])


def _computed(values: Optional[_A], name: str) -> _A:
    if values is None:
        raise RuntimeError(f"lmmetrics: internal error: {name} is not computed by this pass")
    return values


# Logits and reference logits of different dtypes are read a chunk of rows
# at a time, the narrower chunk converted to the wider dtype (16-bit to
# float32, to float64 when one side is float64): extra memory of about this
# many bytes a side.
MIXED_CHUNK_BYTES = 64 * 2**20


def run(logits: Any, targets: Any = None, reference: Any = None, *, ignore_index: Optional[int] = -100,
        softcap: Optional[float] = None, num_threads: Optional[int] = None, shift: Optional[bool] = None,
        nll: bool = False, entropy: bool = False, argmax: bool = False, kl: bool = False,
        ref_nll: bool = False) -> RowResults:
    """One read of the logits (and reference logits) computing what is asked.

    ``logits`` and ``reference`` may be model outputs with ``.logits``;
    with ``shift`` they are aligned with the next target (:func:`shifted`)."""
    threads = check_threads(num_threads)
    cap = check_softcap(softcap)
    ignore = check_ignore_index(ignore_index)
    said = check_shift(shift)
    if said is None and targets is not None:  # without targets (entropy, KL) there is nothing to align
        _shift_must_be_said(logits, reference)
    logits, reference = model_logits(logits), model_logits(reference)
    if said:
        logits, targets, reference = shifted(logits, targets, reference)
    if (kl or ref_nll) and reference is None:
        raise ValueError("reference_logits are required for the KL divergence")
    if isinstance(logits, Projected) or isinstance(reference, Projected):
        return _run_lazy(logits, targets, reference, ignore, cap, threads,
                         dict(nll=nll, entropy=entropy, argmax=argmax, kl=kl, ref_nll=ref_nll))
    if is_cuda(logits) or is_cuda(reference):
        from . import _cuda

        c_lg = _cuda.describe(logits)
        c_ref = None if reference is None else _cuda.describe(reference, "reference_logits")
        out = _results(c_lg, c_ref, targets, ignore, check_range=True, nll=nll, entropy=entropy,
                       argmax=argmax, kl=kl, ref_nll=ref_nll)
        if c_lg.n_rows == 0:
            return out
        _cuda.compute(c_lg, c_ref, out, ignore, cap)
        if out.targets is not None:
            out.n_counted = int(np.count_nonzero(out.counted))
        if out.nll is not None:
            out.nll_sum = float(np.sum(out.nll))
        return out
    lg = as_logits(logits)
    ref = None if reference is None else as_logits(reference, "reference_logits")
    out = _results(lg, ref, targets, ignore, check_range=False, nll=nll, entropy=entropy,
                   argmax=argmax, kl=kl, ref_nll=ref_nll)
    if lg.n_rows == 0:
        return out
    if ref is not None and ref.dtype != lg.dtype:
        n_counted = _native_mixed(lg, ref, out, cap, threads)
        nll_sum = _fsum(out.nll) if out.nll is not None and out.targets is not None else 0.0
    else:
        if ref is not None:
            lg, ref = _same_layout(lg, ref)
        nll_sum, n_counted = _native(lg, ref, out, None, cap, threads)
    if out.targets is not None:
        out.n_counted = n_counted
    out.nll_sum = nll_sum
    return out


def _shift_must_be_said(*inputs: Any) -> None:
    """A model output (``.logits``) or a model's lazy logits come with the
    ids the model read, unshifted by nature: without shift=True / False the
    targets could be either, and a guess is a plausible wrong number."""
    for x in inputs:
        if x is None or isinstance(x, np.ndarray) or is_torch(x):
            continue
        if isinstance(x, Projected) and not x.from_model:
            continue
        if isinstance(x, Projected) or hasattr(x, "logits"):
            what = "lmmetrics.model_logits()" if isinstance(x, Projected) else f"a model output ({type(x).__name__})"
            raise ValueError(
                f"the logits come from {what}: say shift=True when the targets are the model's input ids or "
                f"Hugging Face labels (position t predicts targets[..., t + 1]), or shift=False when they "
                f"are already aligned with the logits (position t predicts targets[..., t])")


def _results(lg: DescribedLogits, ref: Optional[DescribedLogits], targets: Any, ignore: int, *,
             check_range: bool, nll: bool, entropy: bool, argmax: bool, kl: bool,
             ref_nll: bool) -> RowResults:
    """The checks of both buffers and the targets against each other, and
    the outputs of a pass over them, allocated (not yet computed)."""
    if ref is not None and ref.lead_shape + (ref.n_cols,) != lg.lead_shape + (lg.n_cols,):
        raise ValueError(
            f"reference_logits shape {ref.lead_shape + (ref.n_cols,)} does not match "
            f"logits shape {lg.lead_shape + (lg.n_cols,)}")
    if targets is not None:
        tgt = as_targets(targets, lg, check_range=check_range, ignore_index=ignore)
    elif nll or ref_nll:
        raise ValueError("targets are required for the NLL")
    else:
        tgt = None
    n = lg.n_rows
    out = RowResults(lg.lead_shape, lg.n_cols, lg.dtype, _device(lg.keep), tgt, ignore, n_counted=n)
    out.nll = np.empty(n, np.float64) if nll else None
    out.entropy = np.empty(n, np.float64) if entropy else None
    out.argmax = np.empty(n, np.int64) if argmax else None
    out.kl = np.empty(n, np.float64) if kl else None
    out.ref_argmax = np.empty(n, np.int64) if (ref is not None and argmax) else None
    out.ref_nll = np.empty(n, np.float64) if (ref is not None and ref_nll) else None
    return out


def _fsum(values: npt.NDArray[np.float64]) -> float:
    """The correctly rounded sum of non-negative values (NLL): inf where it
    overflows (math.fsum raises there)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def _native(lg: Logits, ref: Optional[Logits], out: RowResults, rows: Optional[slice], cap: float,
            threads: int) -> Tuple[float, int]:
    """The native core over rows ``rows`` of out (None: all; lg and ref
    describe just those rows): fills out's arrays there; returns (NLL sum,
    rows counted)."""
    o = out if rows is None else _rows_of(out, rows)
    tgt = o.targets
    first = 0 if rows is None else rows.start
    status, bad, nll_sum, n_counted = _core.run(
        dtype=_core.DTYPES[lg.dtype], n_rows=lg.n_rows, n_cols=lg.n_cols, rows_inner=lg.rows_inner,
        logits=(lg.ptr, lg.row_stride, lg.outer_stride),
        reference=(ref.ptr, ref.row_stride, ref.outer_stride) if ref else None,
        targets=tgt, ignore_index=out.ignore_index, softcap=cap,
        outputs=(o.nll, o.entropy, o.argmax, o.kl, o.ref_argmax, o.ref_nll), num_threads=threads)
    if not status:
        return nll_sum, n_counted
    if status == Status.LM_ERR_TARGET and tgt is not None:
        raise target_error(int(tgt[bad]), first + bad, lg.n_cols, out.lead_shape)
    if status in ROW_STATUSES:
        raise row_error(status, first + bad, out.lead_shape)
    if status == Status.LM_ERR_NOMEM:
        raise MemoryError("lmmetrics: the native core could not allocate its work buffers")
    if status != Status.LM_OK:
        raise RuntimeError(f"lmmetrics: internal error {status!r} in the native core")
    return nll_sum, n_counted


def _rows_of(out: RowResults, rows: slice) -> RowResults:
    """out's targets and outputs over just rows (views into out's arrays)"""
    def part(a: Optional[_A]) -> Optional[_A]:
        return a if a is None else a[rows]  # type: ignore[return-value]  # a view keeps the type

    return replace(out, targets=part(out.targets), nll=part(out.nll), entropy=part(out.entropy),
                   argmax=part(out.argmax), kl=part(out.kl), ref_argmax=part(out.ref_argmax),
                   ref_nll=part(out.ref_nll))


def _native_mixed(lg: Logits, ref: Logits, out: RowResults, cap: float, threads: int) -> int:
    """Logits and reference of different dtypes: the native core a chunk of
    rows at a time, each side read in place when it has the wider dtype,
    else its chunk converted to it. Returns the rows counted."""
    wide = "float64" if "float64" in (lg.dtype, ref.dtype) else "float32"
    step = max(1, MIXED_CHUNK_BYTES // (lg.n_cols * np.dtype(wide).itemsize))
    n_counted, pos = 0, 0
    for zb, rb in row_blocks(lg.keep, ref.keep):
        for a in range(0, zb.shape[0], step):
            rows = slice(pos + a, pos + min(zb.shape[0], a + step))
            z = as_logits(_as_dtype(zb[a:a + step], wide))
            r = as_logits(_as_dtype(rb[a:a + step], wide), "reference_logits")
            n_counted += _native(z, r, out, rows, cap, threads)[1]
        pos += zb.shape[0]
    return n_counted


def _as_dtype(x: Any, name: str) -> Any:
    """x in the dtype called name (float32 or float64): x itself when it has it."""
    if isinstance(x, np.ndarray):
        return x.astype(name, copy=False)
    import torch

    return x.to(getattr(torch, name))


def _device(x: Any) -> Optional[torch.device]:
    return x.device if hasattr(x, "device") and not isinstance(x, np.ndarray) else None


def _regroup(x: Logits, rows_inner: int) -> Logits:
    """The same rows as x, grouped by rows_inner (x must be one group)."""
    return replace(x, rows_inner=rows_inner, outer_stride=rows_inner * x.row_stride)


def _same_layout(lg: Logits, ref: Logits) -> Tuple[Logits, Logits]:
    """The core takes one row grouping for both buffers: regroup a one-group
    buffer to the other's grouping, or copy the reference contiguous."""
    if ref.rows_inner == lg.rows_inner or lg.n_rows == 0:
        return lg, ref
    if ref.rows_inner == ref.n_rows:
        return lg, _regroup(ref, lg.rows_inner)
    if lg.rows_inner == lg.n_rows:
        return _regroup(lg, ref.rows_inner), ref
    return lg, _regroup(as_logits(_contiguous(ref.keep), "reference_logits"), lg.rows_inner)


def _contiguous(x: Any) -> Any:
    return x.contiguous() if hasattr(x, "contiguous") else np.ascontiguousarray(x)


@dataclass
class _LazyShape:
    """Lazy logits (or the plain logits beside them) as a DescribedLogits:
    what the checks and the outputs need, no buffer."""

    keep: Any
    dtype: str
    lead_shape: Tuple[int, ...]
    n_cols: int
    n_rows: int


def _lazy_shape(x: Any) -> _LazyShape:
    shape = tuple(int(n) for n in x.shape)
    dtype = x.dtype if isinstance(x, Projected) else str(x.dtype).replace("torch.", "")
    return _LazyShape(x, dtype, shape[:-1], shape[-1], math.prod(shape[:-1]))


_OUTPUTS = ("nll", "entropy", "kl", "ref_nll", "argmax", "ref_argmax")
# Lazy logits whose whole-vocabulary rows do not fit the chunk budget this
# many at a time are cut into tiles of rows x a vocabulary block: a matmul of
# few rows re-reads the whole head for little work (64 rows ran at 0.4 of the
# full matmul's speed on the host, 2048 rows at its speed); the per-block
# results merge exactly in float64 (_merge_blocks).
_TILE_ROWS = 2048
_MIN_BLOCK = 512


def _run_lazy(logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int,
              want: Dict[str, bool]) -> RowResults:
    """``run`` over lazy logits (either side or both): the counted rows (all
    rows without targets) a bounded chunk at a time, each chunk's logits
    computed, passed through ``run`` as plain logits, and dropped."""
    lg, ref = _lazy_shape(logits), None if reference is None else _lazy_shape(reference)
    if ref is not None and ref.n_cols != lg.n_cols:
        raise ValueError(f"the model's vocabulary ({lg.n_cols}) and the reference's ({ref.n_cols}) differ: "
                         f"a KL divergence needs one vocabulary")
    sides = [x for x in (logits, reference) if x is not None]
    if cap and any(isinstance(x, Projected) and x.softcap for x in sides):
        raise ValueError("softcap is given both to the metric and to projected(): give it once "
                         "(projected()'s applies to those logits only)")
    out = _results(lg, ref, targets, ignore, check_range=True, **want)
    for name in _OUTPUTS:
        arr = getattr(out, name)
        if arr is not None:  # ignored rows: as the core leaves them
            arr.fill(-1 if "argmax" in name else 0)
    rows = np.flatnonzero(out.counted) if out.targets is not None else np.arange(lg.n_rows)
    lazy = [x for x in sides if isinstance(x, Projected)]
    budget = lazy[0].chunk_bytes or (_cuda_chunk_bytes() if any(is_cuda(x.hidden) for x in lazy)
                                     else DEFAULT_CHUNK_BYTES)
    per_col = sum(x.itemsize if isinstance(x, Projected) else x.dtype.itemsize
                  if isinstance(x, np.ndarray) else x.element_size() for x in sides)
    V = lg.n_cols
    step = max(1, budget // (V * per_col))
    block = V
    if step < min(rows.size, _TILE_ROWS) and V > _MIN_BLOCK:  # tiles of rows x a vocabulary block
        step = max(1, min(rows.size, _TILE_ROWS, budget // (_MIN_BLOCK * per_col)))
        block = max(_MIN_BLOCK, budget // (step * per_col))
    for a in range(0, rows.size, step):
        sel = rows[a:a + step]
        t = None if out.targets is None else out.targets[sel]
        if block >= V:
            _lazy_rows(logits, reference, sel, t, out, lg.lead_shape, cap, threads, want)
        else:
            _lazy_tiles(logits, reference, sel, t, out, lg.lead_shape, block, cap, threads, want)
    out.n_counted = int(rows.size)
    out.nll_sum = _fsum(out.nll) if out.nll is not None else 0.0
    return out


def _lazy_rows(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
               lead: Tuple[int, ...], cap: float, threads: int, want: Dict[str, bool]) -> None:
    """Rows sel, whole, through ``run``; their results into out."""
    z = _take_rows(logits, sel, lead)
    r = None if reference is None else _take_rows(reference, sel, lead)
    try:
        part = run(z, t, r, ignore_index=-1, softcap=cap or None, num_threads=threads or None, **want)
    except RowError as e:  # the row in the input, not in the chunk
        raise row_error(e.status, int(sel[e.row]), lead) from None
    for name in _OUTPUTS:
        arr = getattr(out, name)
        if arr is not None:
            arr[sel] = getattr(part, name)


def _lazy_tiles(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                lead: Tuple[int, ...], block: int, cap: float, threads: int, want: Dict[str, bool]) -> None:
    """Rows sel a vocabulary block at a time: each tile through ``run`` with
    every target at the block's first column, which gives the block's
    logsumexp (its NLL plus that logit); the blocks merged in float64. A row
    the blocks cannot certify (a block all -inf, +inf logits) is done again
    whole, alone."""
    V = out.n_cols
    n = sel.size
    ref = reference is not None
    kw = dict(nll=True, entropy=want["entropy"], argmax=want["argmax"], kl=want["kl"], ref_nll=ref)
    blocks: Dict[str, List[Any]] = {k: [] for k in ("lse", "ent", "amv", "am", "rlse", "kl", "ramv", "ram")}
    zt = np.zeros(n)
    rt = np.zeros(n)
    redo = np.zeros(n, bool)
    col0 = np.zeros(n, np.int64)
    for j in range(0, V, block):
        cols = slice(j, min(V, j + block))
        z = _take_rows(logits, sel, lead, cols, cap)
        r = None if not ref else _take_rows(reference, sel, lead, cols, cap)
        try:
            part = run(z, col0, r, ignore_index=-1, num_threads=threads or None, **kw)
        except RowError as e:
            if e.status not in (Status.LM_ERR_EMPTY, Status.LM_ERR_EMPTY_REF):
                raise row_error(e.status, int(sel[e.row]), lead) from None
            _lazy_rows_alone(logits, reference, sel, t, out, lead, cap, threads, want)  # a block all -inf
            return
        rows_n = np.arange(n)
        with np.errstate(invalid="ignore"):  # inf + -inf: the row is done again whole
            blocks["lse"].append(part.floats("nll") + _at(z, rows_n, col0))
        if want["entropy"]:
            blocks["ent"].append(part.floats("entropy"))
        if want["argmax"]:
            am = part.indices("argmax")
            blocks["am"].append(am + j)
            blocks["amv"].append(_at(z, rows_n, am))
        if t is not None:
            inb = np.flatnonzero((t >= cols.start) & (t < cols.stop))
            zt[inb] = _at(z, inb, t[inb] - j)
        if ref:
            with np.errstate(invalid="ignore"):
                blocks["rlse"].append(part.floats("ref_nll") + _at(r, rows_n, col0))
            if want["kl"]:
                blocks["kl"].append(part.floats("kl"))
            if want["argmax"]:
                ram = part.indices("ref_argmax")
                blocks["ram"].append(ram + j)
                blocks["ramv"].append(_at(r, rows_n, ram))
            if t is not None:
                rt[inb] = _at(r, inb, t[inb] - j)
    lse, lw = _merge_lse(blocks["lse"])
    redo |= ~np.isfinite(lse)
    res: Dict[str, Any] = {}
    if t is not None and out.nll is not None:
        res["nll"] = lse - zt
    if want["entropy"]:  # H = sum_b w_b (H_b - ln w_b), w_b the block's share of the mass
        res["entropy"] = _weighted(lw, [e - v for e, v in zip(blocks["ent"], lw)])
    if want["argmax"]:
        res["argmax"] = _take_best(blocks["amv"], blocks["am"])
    if ref:
        rlse, rlw = _merge_lse(blocks["rlse"])
        redo |= ~np.isfinite(rlse)
        if t is not None and out.ref_nll is not None:
            res["ref_nll"] = rlse - rt
        if want["kl"]:  # KL = sum_b W_b (KL_b + ln W_b - ln w_b), W_b the reference's share
            res["kl"] = _weighted(rlw, [k + rv - v for k, rv, v in zip(blocks["kl"], rlw, lw)])
        if want["argmax"]:
            res["ref_argmax"] = _take_best(blocks["ramv"], blocks["ram"])
    for name, values in res.items():
        arr = getattr(out, name)
        if arr is not None:
            arr[sel] = values if "argmax" in name else np.where(values < 0, 0.0, values)
    if redo.any():
        _lazy_rows_alone(logits, reference, sel[redo], None if t is None else t[redo], out, lead, cap, threads,
                         want)


def _lazy_rows_alone(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                     lead: Tuple[int, ...], cap: float, threads: int, want: Dict[str, bool]) -> None:
    """Rows sel one at a time, each whole (a row's vocabulary at once)."""
    for i in range(sel.size):
        _lazy_rows(logits, reference, sel[i:i + 1], None if t is None else t[i:i + 1], out, lead, cap, threads,
                   want)


def _merge_lse(parts: List[F64Array]) -> Tuple[F64Array, List[F64Array]]:
    """The logsumexp over blocks of the blocks' logsumexps, and each block's
    ln share of the mass (lse_b - lse)."""
    stack = np.stack(parts)
    with np.errstate(all="ignore"):
        m = stack.max(0)
        lse = m + np.log(np.exp(stack - m).sum(0))
        return lse, list(stack - lse)


def _weighted(log_shares: List[F64Array], values: List[F64Array]) -> F64Array:
    """sum_b exp(log_share_b) value_b, a block without mass adding nothing."""
    total = np.zeros_like(log_shares[0])
    with np.errstate(all="ignore"):
        for lw, v in zip(log_shares, values):
            w = np.exp(lw)
            total += np.where(w > 0, w * v, 0.0)
    return total


def _take_best(values: List[F64Array], index: List[I64Array]) -> I64Array:
    """Per row the index of the largest value over blocks, the first block on
    ties (each block's argmax is its first maximum)."""
    k = np.argmax(np.stack(values), 0)
    picked: I64Array = np.stack(index)[k, np.arange(k.size)]
    return picked


def _at(x: Any, rows: I64Array, cols: I64Array) -> F64Array:
    """x[rows[i], cols[i]] as float64 numpy (the few values a tile's merge
    reads; for tensors one small copy to the host)."""
    if is_torch(x):
        import torch

        dev = x.device
        picked = x[torch.from_numpy(rows).to(dev), torch.from_numpy(np.ascontiguousarray(cols)).to(dev)]
        host: F64Array = picked.to("cpu", torch.float64).numpy()
        return host
    return np.asarray(x[rows, cols], np.float64)


def _cuda_chunk_bytes() -> int:
    from . import _cuda

    return _cuda._chunk_bytes


def _take_rows(x: Any, rows: I64Array, lead_shape: Tuple[int, ...], cols: Optional[slice] = None,
               cap: float = 0.0) -> Any:
    """Rows ``rows`` (flat row numbers) of logits x as (len(rows), V), or
    their columns ``cols`` capped by ``cap``: lazy logits computed now, plain
    ones copied (those rows only)."""
    if isinstance(x, Projected):
        return x.rows(rows) if cols is None else x.rows(rows, cols, cap)
    if cols is not None:
        tile = _take_rows(x, rows, lead_shape)[:, cols]
        if not cap:
            return tile
        return np.tanh(tile / cap) * cap if isinstance(tile, np.ndarray) else (tile.float() / cap).tanh() * cap
    index = np.unravel_index(rows, lead_shape) if lead_shape else (np.zeros_like(rows),)
    if is_torch(x):
        import torch

        x = x.detach()
        if not lead_shape:
            x = x[None]
        return x[tuple(torch.from_numpy(np.ascontiguousarray(k)).to(x.device) for k in index)]
    return np.asarray(x)[index] if lead_shape else np.asarray(x)[None][index]
