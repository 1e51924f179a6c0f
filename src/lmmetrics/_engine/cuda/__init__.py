"""CUDA tensors: the choice between the Triton kernel (`.triton`) and
torch (`.torch_path`), a pass's per-row results kept on the device
(`launch`) until one transfer (`settle`), and the rows the fast
paths cannot certify done again by the exact path (`exact_rows`). The
buffer both write is described once, in `.layout`."""
from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np

from ..device import to_device
from ..errors import Status, row_error
from ..request import INDEX_OUTPUTS, OUTPUTS, RowResults
from ..types import BoolArray, F64Array, I64Array
from .layout import (ERRORS, F_EMPTY, F_NAN, F_NAN_REF, N_RESULTS, RES_FLAGS, SLOW, CudaLogits, chunk_bytes, row,
                     set_cuda_chunk_bytes)
from .torch_path import _chunk_exact, _compute_torch, _flat, _take

if TYPE_CHECKING:
    import torch

__all__ = ["CudaLogits", "compute", "describe", "exact_rows", "launch", "set_cuda_chunk_bytes", "settle"]


def describe(x: Any, name: str = "logits") -> CudaLogits:
    import torch

    from ..inputs import is_cuda, torch_dtype_name

    if not is_cuda(x):
        where = x.device if isinstance(x, torch.Tensor) else "the host"
        raise ValueError(f"{name} is on {where} while the other logits are on a CUDA device; "
                         f"put both on the same device")
    dtype = torch_dtype_name(x, name)
    shape = tuple(int(n) for n in x.shape)
    if shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis (shape {shape})")
    return CudaLogits(x.detach(), dtype, shape[:-1], shape[-1], math.prod(shape[:-1]))


# The Triton path (lmmetrics._engine.cuda.triton): taken for CUDA tensors when triton
# imports (LMMETRICS_TRITON=0 turns it off); tests set _force_triton to
# route CPU tensors through it under TRITON_INTERPRET=1.
_force_triton = False
_triton_failed = False


def _triton_for(lg: CudaLogits, ref: Optional[CudaLogits], rank: bool) -> Any:
    """The Triton module when it takes these logits, else None."""
    if _triton_failed or os.environ.get("LMMETRICS_TRITON", "1") == "0":
        return None
    if not (_force_triton or lg.keep.device.type == "cuda"):
        return None
    try:
        from . import triton as _triton
    except Exception:  # triton absent or unusable here: the torch path
        return None
    return _triton if _triton.usable(lg, ref, rank) else None


def compute(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, ignore_index: int, cap: float) -> None:
    """Fill out's per-row arrays (numpy, on the host), its counted rows and
    its NLL sum from the CUDA tensors: the pass launched (`launch`),
    its results brought to the host once (`settle`), the rows it
    could not certify done again by the exact path."""
    res, tgt_all = launch(lg, ref, out, cap)
    slow = settle(res, out, None, lg.lead_shape)
    if slow.size:
        exact_rows(slow, lg, ref, out, cap, tgt_all)
    if out.targets is not None:
        out.n_counted = int(np.count_nonzero(out.counted))
    if out.nll is not None:
        out.nll_sum = float(np.sum(out.nll))


def launch(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, cap: float,
           targets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The pass over the CUDA tensors for the outputs out asks for, queued
    on the device (nothing waits for it): the Triton kernel where it
    applies, else torch, each chunk's per-row values and flags into one
    buffer. Returns that buffer (N_RESULTS x rows, float64, on the device)
    and the targets on the device (-1 where a row is not counted): out's,
    or targets (already there, every row counted: a lazy tile's)."""
    global _triton_failed
    import torch

    dev = lg.keep.device
    tgt_all = targets if targets is not None else \
        None if out.targets is None else to_device(np.where(out.counted, out.targets, -1), dev)
    res = torch.empty((N_RESULTS, lg.n_rows), dtype=torch.float64, device=dev)
    tri = _triton_for(lg, ref, out.rank is not None)
    if tri is not None:
        try:
            tri.compute(lg, ref, out, res, tgt_all, cap)
            return res, tgt_all
        except tri.LaunchError as e:  # e.g. a GPU the installed triton cannot compile for
            if _force_triton:
                raise
            _triton_failed = True
            warnings.warn(f"lmmetrics: the Triton kernel failed ({e.__cause__!r}); "
                          f"using the torch path from now on", RuntimeWarning, stacklevel=4)
    _compute_torch(lg, ref, out, res, tgt_all, cap)
    return res, tgt_all


def _fetch(res: torch.Tensor, out: RowResults) -> Tuple[I64Array, Dict[str, F64Array]]:
    """The flags of res's rows and the outputs out asks for, in one transfer
    to the host (the only one of a pass whose rows the fast paths certify)."""
    import torch

    names = [name for name in OUTPUTS if getattr(out, name) is not None]
    host = torch.stack([res[RES_FLAGS]] + [res[row(name)] for name in names]).cpu().numpy()
    return host[0].astype(np.int64), dict(zip(names, host[1:]))


def _check_rows(flags: I64Array, counted: BoolArray, rows: Optional[I64Array], lead_shape: Tuple[int, ...]) -> None:
    """Raise the native core's error for the first counted row flagged bad
    (rows: the flat row numbers of the flags' rows; None: their positions)."""
    bad = counted & ((flags & ERRORS) != 0)
    if bad.any():
        i = int(np.argmax(bad))
        f = flags[i]
        status = (Status.LM_ERR_NAN if f & F_NAN else Status.LM_ERR_EMPTY if f & F_EMPTY
                  else Status.LM_ERR_NAN_REF if f & F_NAN_REF else Status.LM_ERR_EMPTY_REF)
        raise row_error(status, i if rows is None else int(rows[i]), lead_shape)


def settle(res: torch.Tensor, out: RowResults, rows: Optional[I64Array], lead_shape: Tuple[int, ...]) -> I64Array:
    """The flags of res's rows and the outputs out asks for, to the host in
    one transfer, into out's arrays at rows (flat row numbers; None: all
    out's rows, in order). Raises for the first bad counted row; returns
    the positions in res of the rows to do again by the exact path (flagged
    so, or a NaN the flags did not foresee)."""
    flags, values = _fetch(res, out)
    counted = out.counted if rows is None else np.ones(flags.size, bool)
    _check_rows(flags, counted, rows, lead_shape)
    slow = counted & ((flags & SLOW) != 0)
    at = slice(None) if rows is None else rows
    for name, v in values.items():
        getattr(out, name)[at] = v  # the integer outputs: exact float64 integers
        if name not in INDEX_OUTPUTS:
            slow |= counted & np.isnan(v)
    return np.flatnonzero(slow)


def exact_rows(idx: I64Array, lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, cap: float,
               tgt_all: Optional[torch.Tensor]) -> None:
    """The counted rows idx (flat row numbers) of out again by the exact path,
    a bounded number of rows at a time, each batch's values to the host in
    one transfer (the rows the fast paths cannot certify: +inf, KL cross
    terms beyond float, a torch chunk with such a row)."""
    import torch

    dev = lg.keep.device
    z2 = _flat(lg.keep)
    r2 = None if ref is None else _flat(ref.keep)
    step = max(1, chunk_bytes() // (lg.n_cols * 8 * 12))  # float64 temporaries
    for a in range(0, idx.size, step):
        part = idx[a:a + step]
        sel = to_device(part, dev)
        n = part.size
        res = torch.empty((N_RESULTS, n), dtype=torch.float64, device=dev)
        _chunk_exact(_take(z2, part, sel), None if r2 is None else _take(r2, part, sel),
                     None if tgt_all is None else tgt_all[sel], torch.ones(n, dtype=torch.bool, device=dev), out,
                     res, cap)
        settle(res, out, part, lg.lead_shape)  # (the exact path's values are final)

