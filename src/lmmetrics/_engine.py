"""The one path from the public functions to a computation.

Every metric calls :func:`run`, which validates arguments with the GIL held,
allocates the per-row float64 outputs, calls the native core once (GIL
released, OpenMP inside) and raises a clear exception for bad rows. CUDA
tensors take the same path up to the computation, which torch does on their
device (:mod:`lmmetrics._cuda`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import numpy as np

from . import _core
from ._errors import ROW_STATUSES, Status, row_error, target_error
from ._inputs import Logits, as_logits, as_targets, is_cuda


@dataclass
class RowResults:
    """Per-row outputs of one pass (numpy, float64 / int64, flattened rows)."""

    lead_shape: Tuple[int, ...]    # the logits shape without the vocabulary axis
    n_cols: int                    # vocabulary size
    dtype: str                     # logits dtype name
    device: Any                    # None for numpy input, else the torch device
    targets: Optional[np.ndarray]  # int64, flattened; None without targets
    ignore_index: int
    n_counted: int = 0             # rows counted
    nll_sum: float = 0.0           # sum of nll over counted rows (when nll is computed)
    nll: Optional[np.ndarray] = None
    entropy: Optional[np.ndarray] = None
    argmax: Optional[np.ndarray] = None
    kl: Optional[np.ndarray] = None
    ref_argmax: Optional[np.ndarray] = None
    ref_nll: Optional[np.ndarray] = None
    _counted: Optional[np.ndarray] = None

    @property
    def counted(self) -> np.ndarray:
        """bool mask of the counted rows (targets neither negative nor ignore_index)"""
        if self._counted is None:
            t = self.targets
            self._counted = (np.ones(math.prod(self.lead_shape), bool) if t is None
                             else (t >= 0) & (t != self.ignore_index))
        return self._counted


MAX_THREADS = 1024
# The kernel applies a softcap in float lanes (c and 1 / c): both must be
# normal float32 numbers with room to spare.
SOFTCAP_RANGE = (1e-30, 1e30)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_threads(num_threads: Optional[int]) -> int:
    """0 for None (the OpenMP default), else the thread count, or ValueError."""
    if num_threads is None:
        return 0
    if (isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer))
            or not 1 <= num_threads <= MAX_THREADS):
        raise ValueError(f"num_threads must be an integer from 1 to {MAX_THREADS}, or None; "
                         f"got {num_threads!r}")
    return int(num_threads)


def check_softcap(softcap: Optional[float]) -> float:
    """0.0 for None (no cap), else the cap as a float: TypeError for what is
    not a real number, ValueError outside SOFTCAP_RANGE."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number or None, got {softcap!r}")
    c = float(softcap)
    lo, hi = SOFTCAP_RANGE
    if not lo <= c <= hi:
        raise ValueError(f"softcap must be a number from {lo:g} to {hi:g} (or None), got {softcap!r}")
    return c


def check_ignore_index(ignore_index: Any) -> int:
    """The ignore_index as an int64 value, or TypeError / ValueError."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index!r}")
    return int(ignore_index)


def run(logits: Any, targets: Any = None, reference: Any = None, *, ignore_index: int = -100,
        softcap: Optional[float] = None, num_threads: Optional[int] = None,
        nll: bool = False, entropy: bool = False, argmax: bool = False, kl: bool = False,
        ref_nll: bool = False) -> RowResults:
    """One read of the logits (and reference logits) computing what is asked."""
    threads = check_threads(num_threads)
    cap = check_softcap(softcap)
    ignore = check_ignore_index(ignore_index)
    if (kl or ref_nll) and reference is None:
        raise ValueError("reference_logits are required for the KL divergence")
    cuda = None
    if is_cuda(logits) or is_cuda(reference):
        from . import _cuda as cuda
    describe = cuda.describe if cuda else as_logits
    lg = describe(logits)
    ref = None
    if reference is not None:
        ref = describe(reference, "reference_logits")
        if ref.lead_shape + (ref.n_cols,) != lg.lead_shape + (lg.n_cols,):
            raise ValueError(
                f"reference_logits shape {ref.lead_shape + (ref.n_cols,)} does not match "
                f"logits shape {lg.lead_shape + (lg.n_cols,)}")
        if ref.dtype != lg.dtype:
            raise TypeError(
                f"reference_logits dtype {ref.dtype} differs from logits dtype {lg.dtype}; "
                f"convert one of them so that both match")
        if not cuda:
            lg, ref = _same_layout(lg, ref)
    if targets is not None:
        tgt = as_targets(targets, lg, check_range=cuda is not None, ignore_index=ignore)
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
    if n == 0:
        return out
    if cuda:
        cuda.compute(lg, ref, out, ignore, cap)
        if tgt is not None:
            out.n_counted = int(np.count_nonzero(out.counted))
        if nll:
            out.nll_sum = float(np.sum(out.nll))
        return out

    status, bad, nll_sum, n_counted = _core.run(
        dtype=lg.dtype_code, n_rows=n, n_cols=lg.n_cols, rows_inner=lg.rows_inner,
        logits=(lg.ptr, lg.row_stride, lg.outer_stride),
        reference=(ref.ptr, ref.row_stride, ref.outer_stride) if ref else None,
        targets=tgt, ignore_index=ignore, softcap=cap, nll=out.nll, entropy=out.entropy,
        argmax=out.argmax, kl=out.kl, ref_argmax=out.ref_argmax, ref_nll=out.ref_nll,
        num_threads=threads)
    if status == Status.LM_ERR_TARGET:
        raise target_error(tgt[bad], bad, lg.n_cols, lg.lead_shape)
    if status in ROW_STATUSES:
        raise row_error(status, bad, lg.lead_shape)
    if status == Status.LM_ERR_NOMEM:
        raise MemoryError("lmmetrics: the native core could not allocate its work buffers")
    if status != Status.LM_OK:
        raise RuntimeError(f"lmmetrics: internal error {status!r} in the native core")
    if tgt is not None:
        out.n_counted = n_counted
    out.nll_sum = nll_sum
    return out


def _device(x):
    return x.device if hasattr(x, "device") and not isinstance(x, np.ndarray) else None


def _regroup(x: Logits, rows_inner: int) -> Logits:
    """The same rows as x, grouped by rows_inner (x must be one group)."""
    return replace(x, rows_inner=rows_inner, outer_stride=rows_inner * x.row_stride)


def _same_layout(lg: Logits, ref: Logits):
    """The core takes one row grouping for both buffers: regroup a one-group
    buffer to the other's grouping, or copy the reference contiguous."""
    if ref.rows_inner == lg.rows_inner or lg.n_rows == 0:
        return lg, ref
    if ref.rows_inner == ref.n_rows:
        return lg, _regroup(ref, lg.rows_inner)
    if lg.rows_inner == lg.n_rows:
        return _regroup(lg, ref.rows_inner), ref
    return lg, _regroup(as_logits(_contiguous(ref.keep), "reference_logits"), lg.rows_inner)


def _contiguous(x):
    return x.contiguous() if hasattr(x, "contiguous") else np.ascontiguousarray(x)
