"""The native backend: the only caller of the compiled core (``_core.run``).

`compute` fills a `lmmetrics._engine.request.RowResults` from
described host buffers (numpy arrays, torch CPU tensors) in one call of the
core (GIL released, OpenMP inside), or a bounded chunk of rows at a time
when the logits and the reference logits differ in dtype; a bad row or
target raises the error that names it."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Tuple

import numpy as np

from .. import _core
from .errors import ROW_STATUSES, Status, row_error, target_error
from .inputs import Logits, as_logits, row_chunks
from .request import RowResults, fsum, outputs_of

def nll_total(logits: np.ndarray[Any, Any], targets: np.ndarray[Any, Any], ignore: int,
              threads: int) -> Optional[Tuple[float, int]]:
    """(NLL sum, rows counted) of a plain call, checked and computed in the
    compiled binding with no per-row output allocated (a one-row call's
    fixed cost); None where the call is not plain or a row or target is bad
    (``_core.nll_total`` says which calls are plain)."""
    return _core.nll_total(logits, targets, ignore, threads)


def compute(lg: Logits, ref: Optional[Logits], out: RowResults, cap: float, threads: int) -> None:
    """Fill out's arrays, its counted rows and its NLL sum (lg has rows)."""
    if ref is not None and ref.dtype != lg.dtype:
        n_counted = _mixed(lg, ref, out, cap, threads)
        nll_sum = fsum(out.nll) if out.nll is not None and out.targets is not None else 0.0
    else:
        if ref is not None:
            lg, ref = _same_layout(lg, ref)
        nll_sum, n_counted = _pass(lg, ref, out, None, cap, threads)
    if out.targets is not None:
        out.n_counted = n_counted
    out.nll_sum = nll_sum


# Logits and reference logits of different dtypes are read a chunk of rows
# at a time, the narrower chunk converted to the wider dtype (16-bit to
# float32, to float64 when one side is float64): extra memory of about this
# many bytes a side.
MIXED_CHUNK_BYTES = 64 * 2**20


def _pass(lg: Logits, ref: Optional[Logits], out: RowResults, rows: Optional[slice], cap: float,
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
        outputs=outputs_of(o), num_threads=threads)
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
    return out.derived(out.lead_shape, None if out.targets is None else out.targets[rows], lambda a: a[rows])


def _mixed(lg: Logits, ref: Logits, out: RowResults, cap: float, threads: int) -> int:
    """Logits and reference of different dtypes: the native core a chunk of
    rows at a time, each side read in place when it has the wider dtype,
    else its chunk converted to it. Returns the rows counted."""
    wide = "float64" if "float64" in (lg.dtype, ref.dtype) else "float32"
    step = max(1, MIXED_CHUNK_BYTES // (lg.n_cols * np.dtype(wide).itemsize))
    n_counted = 0
    for rows, zc, rc in row_chunks(lg.keep, ref.keep, step):
        z = as_logits(_as_dtype(zc, wide))
        r = as_logits(_as_dtype(rc, wide), "reference_logits")
        n_counted += _pass(z, r, out, rows, cap, threads)[1]
    return n_counted


def _as_dtype(x: Any, name: str) -> Any:
    """x in the dtype called name (float32 or float64): x itself when it has it."""
    if isinstance(x, np.ndarray):
        return x.astype(name, copy=False)
    import torch

    return x.to(getattr(torch, name))


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
