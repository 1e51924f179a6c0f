"""CUDA tensors: the choice between the Triton kernel (`.triton`) and
torch (`.torch_path`), a pass's per-row results kept on the device
(`launch`) until one transfer (`settle`), and the rows the fast
paths cannot certify done again by the exact path (`exact_rows`). The
buffer both write is described once, in `.layout`."""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import numpy as np

from .. import inputs as _inputs
from ..device import is_torch, to_device
from ..errors import Status, row_error, target_error
from ..inputs import as_targets
from ..request import INDEX_OUTPUTS, OUTPUTS, RowResults
from ..types import BoolArray, F64Array, I64Array
from .layout import (ERRORS, F_COUNTED, F_EMPTY, F_NAN, F_NAN_REF, F_OOB, N_RESULTS, RES_FLAGS, RES_TARGETS, SLOW,
                     CudaLogits, chunk_bytes, row, rows_of,
                     set_cuda_chunk_bytes)
from .torch_path import _chunk_exact, _compute_torch, _flat, _take

if TYPE_CHECKING:
    import torch

__all__ = ["CudaLogits", "compute", "describe", "device_total", "exact_rows", "launch", "set_cuda_chunk_bytes",
           "settle"]


def describe(x: Any, name: str = "logits") -> CudaLogits:
    import torch

    if not _inputs.is_cuda(x):  # (read from its module each call: tests route CPU tensors here)
        where = x.device if isinstance(x, torch.Tensor) else "the host"
        raise ValueError(f"{name} is on {where} while the other logits are on a CUDA device; "
                         f"put both on the same device")
    dtype = _inputs.torch_dtype_name(x, name)
    x = _inputs.torch_values(x, name)
    shape = tuple(x.shape)
    if shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis (shape {shape})")
    x, rows = rows_of(x, len(shape) - 1)
    return CudaLogits(x, dtype, shape[:-1], shape[-1], math.prod(shape[:-1]), rows)


#: integer dtypes a kernel reads as they are (others: converted on the host)
_DEVICE_INDEX = ("torch.int64", "torch.int32", "torch.int16", "torch.int8", "torch.uint8")


def device_targets(targets: Any, lg: CudaLogits) -> torch.Tensor:
    """The targets on the logits' device, checked for what needs no look at
    their values (dtype, shape): a tensor already there as it is (no copy,
    no wait for the device; copied only when no two strides describe its
    rows, as `CudaLogits.rows`); others (numpy, host tensors) converted on
    the host and queued for upload. Their values are checked by the pass
    (`F_OOB`)."""
    t = _inputs.index_array_or_tensor(targets, "targets")
    if not (is_torch(t) and t.device == lg.keep.device and str(t.dtype) in _DEVICE_INDEX):
        return to_device(as_targets(t, lg, check_range=False), lg.keep.device)  # (flat, from the host: no wait)
    _inputs.check_targets_shape(tuple(t.shape), lg)
    kept: torch.Tensor = rows_of(t, t.dim())[0]
    return kept


# The Triton path (lmmetrics._engine.cuda.triton): taken for CUDA tensors when triton
# imports (LMMETRICS_TRITON=0 turns it off); tests set _force_triton to
# route CPU tensors through it under TRITON_INTERPRET=1.
_force_triton = False
_triton_failed = False


def _triton_for(lg: CudaLogits, ref: Optional[CudaLogits]) -> Any:
    """The Triton module when it takes these logits, else None."""
    if _triton_failed or os.environ.get("LMMETRICS_TRITON", "1") == "0":
        return None
    if not (_force_triton or lg.keep.device.type == "cuda"):
        return None
    tri = _triton_module()
    return tri if tri is not None and tri.usable(lg, ref) else None


_triton_mod: Any = False  # (not yet imported)


def _triton_module() -> Any:
    """The Triton module, imported once; None when triton is absent or
    unusable here (the torch path)."""
    global _triton_mod
    if _triton_mod is False:
        try:
            from . import triton as _triton
        except Exception:
            return None  # (asked again next time, as before: an import may fail for a passing reason)
        _triton_mod = _triton
    return _triton_mod


def compute(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, targets: Any, ignore_index: int,
            cap: float, defer: bool = False) -> Callable[[RowResults], None]:
    """Launch the pass over the CUDA tensors and the targets (as given: a
    tensor on the device stays there) for out's outputs (`launch`), and
    return what completes it, given out (not held by it: a pass dropped
    unread frees at once), the one wait for the device: its results
    brought to the host once (`settle`: out's per-row arrays, targets,
    counted rows, NLL sum; the first bad row raises), the rows it could
    not certify done again by the exact path. With defer, on a CUDA
    device, the results' transfer is queued now into page-locked memory
    behind an event: completing the pass waits for that event only, not
    for what was queued on the stream after it."""
    tgt = None if targets is None else device_targets(targets, lg)
    res = launch(lg, ref, out, cap, tgt, ignore_index)
    if defer:  # (with the stream it is queued on: its value is computed there, after it)
        import torch

        out.on_device = (res, torch.cuda.current_stream(lg.keep.device) if lg.keep.device.type == "cuda" else None)
    names, sent, at = _gathered(res, out, tgt is not None)
    early = _queued_copy(sent) if defer else None
    versions = _versions(lg, ref)

    def finish(into: RowResults) -> None:
        host = sent.cpu().numpy() if early is None else early()

        def redo(idx: I64Array) -> None:  # the rows the fast paths could not certify
            if _versions(lg, ref) != versions:
                raise ValueError("the logits of this pass were changed in place before it completed; rows with "
                                 "+inf logits are read again then: keep the logits as they are until the results "
                                 "are read")
            exact_rows(idx, lg, ref, into, cap, None if tgt is None else res[RES_TARGETS])

        settle(res, into, None, lg.lead_shape, tgt, redo=redo, fetched=(names, host, at))
        if into.nll is not None:
            into.nll_sum = float(np.add.reduce(into.nll))  # (np.sum's bits, past its Python wrapper)

    return finish


def device_total(on_device: Tuple[torch.Tensor, Any], name: str, of: Callable[[Any, Any], Any]) -> Any:
    """of(sum, count) of the per-row output name over a pass's counted rows,
    0-d tensors (float64, int64) computed on its device from its result
    buffer (`launch`), queued there with no wait, on the stream the pass
    was queued on (on_device: the buffer and that stream, None off CUDA).
    The sum is NaN where a counted row is an error (named once the results
    are on the host: `settle`) or one the exact path does again there
    (+inf logits). Summed by torch: the host's sum of the same values may
    differ in its last bits. Read on another stream than the pass's, the
    result is ordered on it as torch orders an op's result on the current
    stream: that stream waits for the pass's, and the result's memory is
    kept for it (`torch.Tensor.record_stream`)."""
    import torch

    res, stream = on_device
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        flags = res[RES_FLAGS].to(torch.int64)  # (exact small integers in float64)
        counted = (flags & F_COUNTED) != 0
        values = res[row(name)]
        total = torch.where(counted, values, 0.0).sum()
        unsure = counted & (((flags & (ERRORS | F_OOB | SLOW)) != 0) | values.isnan())
        value = of(torch.where(unsure.any(), math.nan, total), counted.sum())
    if stream is not None:
        reader = torch.cuda.current_stream(res.device)
        if reader != stream:
            reader.wait_stream(stream)
            if isinstance(value, torch.Tensor):
                value.record_stream(reader)
    return value


def _versions(lg: CudaLogits, ref: Optional[CudaLogits]) -> Tuple[int, ...]:
    """The version counters of the logits (torch counts in-place changes;
    -1 for a tensor made under ``torch.inference_mode()``, which counts
    none)."""
    return tuple(_version(x.keep) for x in (lg, ref) if x is not None)


def _version(t: Any) -> int:
    try:
        return int(getattr(t, "_version", 0))
    except RuntimeError:  # (an inference tensor: "Inference tensors do not track version counter")
        return -1


def _queued_copy(sent: torch.Tensor) -> Optional[Callable[[], F64Array]]:
    """A copy of the device tensor sent to the host, queued on the current
    stream (no wait), and what returns it once done (a wait for this copy
    only); None off a CUDA device (the tensor is there already)."""
    import torch

    if sent.device.type != "cuda":
        return None
    host = torch.empty(sent.shape, dtype=sent.dtype, pin_memory=True)
    host.copy_(sent, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()

    def read() -> F64Array:
        done.synchronize()
        values: F64Array = host.numpy()
        return values

    return read


def launch(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, cap: float,
           targets: Optional[torch.Tensor] = None, ignore_index: int = -1) -> torch.Tensor:
    """The pass over the CUDA tensors for the outputs out asks for, queued
    on the device (nothing waits for it): the Triton kernel where it
    applies, else torch, each chunk's per-row values and flags into one
    buffer, returned (N_RESULTS x rows, float64, on the device). The
    targets: a tensor on the device (of the logits' leading shape, or
    flat), rows counted where neither negative nor ignore_index, read
    there (`F_COUNTED`, `F_OOB`, row `RES_TARGETS`); else out's (host)
    targets, uploaded."""
    global _triton_failed
    import torch

    dev = lg.keep.device
    if targets is None and out.targets is not None:
        targets = to_device(np.where(out.counted, out.targets, -1), dev)
    res = torch.empty((N_RESULTS, lg.n_rows), dtype=torch.float64, device=dev)
    tri = _triton_for(lg, ref)
    if tri is not None:
        try:
            tri.compute(lg, ref, out, res, targets, ignore_index, cap)
            return res
        except tri.LaunchError as e:  # e.g. a GPU the installed triton cannot compile for
            if _force_triton:
                raise
            _triton_failed = True
            warnings.warn(f"lmmetrics: the Triton kernel failed ({e.__cause__!r}); "
                          f"using the torch path from now on", RuntimeWarning, stacklevel=4)
    tgt_all = None
    if targets is not None:  # the Triton kernel's reading of the targets, in torch ops (no wait)
        t64 = targets.reshape(-1).long()
        counted = (t64 >= 0) & (t64 != ignore_index)
        oob = counted & (t64 >= lg.n_cols)
        tgt_all = torch.where(counted & ~oob, t64, -1)
    _compute_torch(lg, ref, out, res, tgt_all, cap)
    if targets is not None:
        res[RES_FLAGS] += counted * float(F_COUNTED) + oob * float(F_OOB)
        res[RES_TARGETS] = t64
    return res


# A pass's result buffer of at most this many bytes comes to the host whole
# (its rows picked there: no gather launched on the device for a small
# call); a larger one, the rows asked for only.
_WHOLE_BYTES = 64 * 1024


def _gathered(res: torch.Tensor, out: RowResults, with_targets: bool) -> Tuple[List[str], torch.Tensor, List[int]]:
    """What one transfer brings to the host: the names of its rows (the
    flags, the outputs out asks for and, with_targets, the targets), the
    tensor to bring (on the device: queued, not waited for) and where each
    of those rows is in it (res whole, or those rows gathered on the
    device)."""
    import torch

    names = [name for name in OUTPUTS if getattr(out, name) is not None]
    at = [RES_FLAGS] + [row(name) for name in names] + ([RES_TARGETS] if with_targets else [])
    names += ["targets"] if with_targets else []
    if res.numel() * res.element_size() <= _WHOLE_BYTES:
        return names, res, at
    return names, torch.stack([res[i] for i in at]), list(range(len(at)))


def _first_error(flags: I64Array, counted: BoolArray, rows: Optional[I64Array], lead_shape: Tuple[int, ...],
                 target_values: Optional[F64Array], targets: Any, n_cols: int) -> Optional[Tuple[int, ValueError]]:
    """The first counted row flagged bad and the native core's error for it,
    a target out of range (F_OOB, with the targets' values: as the pass read
    them, and the targets on the device, for a value the float64 copy may
    have rounded) or bad logits (rows: the flat row numbers of the flags'
    rows; None: their positions); None when there is none."""
    bad = counted & ((flags & (ERRORS | F_OOB)) != 0)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    f = flags[i]
    if f & F_OOB and target_values is not None:
        v = target_values[i]
        return i, target_error(int(v) if abs(v) < 2.0**53 else int(targets.reshape(-1)[i].item()), i, n_cols,
                               lead_shape)
    status = (Status.LM_ERR_NAN if f & F_NAN else Status.LM_ERR_EMPTY if f & F_EMPTY
              else Status.LM_ERR_NAN_REF if f & F_NAN_REF else Status.LM_ERR_EMPTY_REF)
    return i, row_error(status, i if rows is None else int(rows[i]), lead_shape)


def settle(res: torch.Tensor, out: RowResults, rows: Optional[I64Array], lead_shape: Tuple[int, ...],
           targets: Optional[torch.Tensor] = None, redo: Optional[Callable[[I64Array], None]] = None,
           fetched: Optional[Tuple[List[str], F64Array, List[int]]] = None) -> None:
    """The flags of res's rows and the outputs out asks for, to the host in
    one transfer (or as fetched already: `_gathered`'s names and row
    positions, with the rows on the host), into out's
    arrays at rows (flat row numbers; None: all out's rows, in order), and
    with targets (the pass's, on the device) out's targets and counted rows
    as the pass read them. The rows to do again by the exact path (flagged
    so, or a NaN the flags did not foresee) go to redo (their positions in
    res), when given. Raises for the first counted row with a bad target or
    bad logits; the rows to do again up to it are done first, so that one
    of them (NaN behind +inf) is named if it comes first, as the core names
    it (and that row's own error, where it is one of them)."""
    if fetched is None:
        names, sent, at = _gathered(res, out, targets is not None)
        host: F64Array = sent.cpu().numpy()
    else:
        names, host, at = fetched
    flags = host[at[0]].astype(np.int64)
    values = {name: host[i] for name, i in zip(names, at[1:])}
    tv = None
    if targets is not None:
        tv = values.pop("targets")
        read = (flags & F_COUNTED) != 0
        out.n_counted = int(np.count_nonzero(read))
        out.targets = tv.astype(np.int64)
        if out.n_counted < read.size:
            # (an ignored target that is not negative is ignore_index
            # itself, which float64 rounds past 2^53)
            out.targets[~read & (tv >= 0)] = out.ignore_index
        out.set_counted(read)
    where = slice(None) if rows is None else rows
    for name, v in values.items():
        getattr(out, name)[where] = v  # the integer outputs: exact float64 integers
    floats = [v for name, v in values.items() if name not in INDEX_OUTPUTS]
    # (ufuncs' reductions called directly: ndarray.any's Python wrapper cost
    # more than the work; a sum is NaN where a value is, and where +inf
    # meets -inf, a row the full check below then clears)
    unsure = int(np.bitwise_or.reduce(flags)) & (ERRORS | F_OOB | SLOW)
    for v in floats:
        unsure = unsure or np.isnan(np.add.reduce(v))
    if not unsure:
        return  # (the common case: no row to name or do again)
    counted = out.counted if rows is None else np.ones(flags.size, bool)
    slow = counted & ((flags & SLOW) != 0)
    for v in floats:
        slow |= counted & np.isnan(v)
    first = _first_error(flags, counted, rows, lead_shape, tv, targets, out.n_cols)
    slow_at = np.flatnonzero(slow)
    if first is not None:
        # (the bad row itself too: +inf hides its side's NaN from the flags,
        # so the other side's error may not be the one the core names)
        if redo is not None and slow_at.size and slow_at[0] <= first[0]:
            redo(slow_at[slow_at <= first[0]])
        raise first[1]
    if redo is not None and slow_at.size:
        redo(slow_at)


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
                     None if tgt_all is None else tgt_all[sel].long(), torch.ones(n, dtype=torch.bool, device=dev), out,
                     res, cap)
        settle(res, out, part, lg.lead_shape)  # (the exact path's values are final)

