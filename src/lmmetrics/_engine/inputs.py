"""Turning user arrays into what the native core reads, without copies.

Logits may be numpy arrays (float32, float64, float16, ml_dtypes.bfloat16),
anything ``np.asarray`` accepts, or torch CPU tensors of the same dtypes.
Only the vocabulary axis must be contiguous; the leading axes may be strided
(``logits[:, :-1]``) and are described to the core by two strides.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from .. import _core
from .device import is_torch as is_torch
from .errors import target_error
from .lazy import Projected
from .types import I64Array

if TYPE_CHECKING:
    import torch

_NUMPY_DTYPES = {"float32", "float64", "float16", "bfloat16"}
_NAMES: Dict[np.dtype[Any], str] = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.float16): "float16"}


def _dtype_name(dt: np.dtype[Any]) -> str:
    name = _NAMES.get(dt)
    if name is None:
        name = dt.name  # slow; cache bfloat16 (ml_dtypes) once seen
        if name == "bfloat16" and dt.isnative:  # as_logits' fast path trusts _NAMES' byte order
            _NAMES[dt] = name
    return name


def is_cuda(x: Any) -> bool:
    """True for a torch tensor on a device other than the CPU (is_cpu: a
    fraction of device.type's cost, which a one-row call sees)."""
    return is_torch(x) and not x.is_cpu


def check_unmasked(x: Any, name: str, fill: Optional[str] = None) -> None:
    """A numpy masked array with some entry masked is a TypeError saying
    what to pass instead (fill: the value for ``.filled()`` that means what
    a mask would, where there is one): its mask would be read as nothing
    (numpy hands over the values under it)."""
    if type(x) is np.ndarray or not isinstance(x, np.ndarray):
        return
    ma = sys.modules.get("numpy.ma")  # (not imported: x cannot be one)
    if ma is not None and isinstance(x, ma.MaskedArray) and ma.getmaskarray(x).any():
        how = (f"pass {name}.filled({fill}) to rule the masked entries out, or .data for the values under "
               f"the mask" if fill else "pass a plain array (.filled(value) or .data)")
        raise TypeError(f"{name} is a numpy masked array with masked entries, whose mask lmmetrics does not "
                        f"read: {how}")


def model_logits(x: Any, name: str = "logits") -> Any:
    """The ``.logits`` of a model output (e.g. transformers'
    ``CausalLMOutputWithPast``); arrays, tensors and None as given. A tuple
    or dict of a model's outputs (``return_dict=False``) is a TypeError
    saying to pass the logits alone (np.asarray failed on it obscurely);
    so is a masked array with masked entries (`check_unmasked`)."""
    if x is None or type(x) is np.ndarray or is_torch(x):
        return x
    if isinstance(x, np.ndarray):
        check_unmasked(x, name, "-np.inf")
        return x
    if hasattr(x, "logits"):
        return x.logits
    if isinstance(x, Mapping) and "logits" in x:
        raise TypeError(f"the logits are a {type(x).__name__} of model outputs: pass outputs['logits'] (or the "
                        f"model output itself, which has .logits)")
    if isinstance(x, (tuple, list)) and len(x) > 1 and (isinstance(x[0], np.ndarray) or is_torch(x[0])):
        shape = tuple(x[0].shape)
        if any(not (isinstance(e, np.ndarray) or is_torch(e)) or tuple(e.shape) != shape for e in x[1:]):
            kinds = ", ".join(type(e).__name__ for e in x[:4]) + (", ..." if len(x) > 4 else "")
            # (a model given labels puts its loss, a scalar, before the logits)
            which = "outputs[1] (outputs[0] is the loss)" if shape == () else "outputs[0]"
            raise TypeError(f"the logits are a {type(x).__name__} of {kinds}, not one array: for a model's "
                            f"outputs with return_dict=False pass the logits alone, {which}; arrays of "
                            f"different shapes go one call each")
    return x


def shifted(logits: Any, targets: Any, reference: Any = None) -> Tuple[Any, Any, Any]:
    """Next-token alignment of unshifted inputs (Hugging Face labels):
    position t is scored against targets[..., t + 1] and the last position
    is dropped. Views of the logits (numpy or torch, any device), no copy;
    lazy logits drop their last hidden state."""
    logits = _array(logits)
    if logits.ndim < 2:
        raise ValueError(f"shift=True needs logits with a time axis (..., T, V), got shape "
                         f"{tuple(logits.shape)}")
    lead = tuple(int(n) for n in logits.shape[:-1])
    if targets is not None:
        targets = index_array_or_tensor(targets, "targets")
        if tuple(targets.shape) != lead:
            raise ValueError(f"targets shape {tuple(targets.shape)} does not match the logits shape "
                             f"without its vocabulary axis {lead} (shift=True takes both unshifted)")
        targets = targets[..., 1:]
    if reference is not None:
        reference = _array(reference)
        if tuple(reference.shape) != tuple(logits.shape):
            raise ValueError(f"reference_logits shape {tuple(reference.shape)} does not match logits "
                             f"shape {tuple(logits.shape)}")
        reference = _drop_last(reference)
    return _drop_last(logits), targets, reference


def _drop_last(x: Any) -> Any:
    """x without its last position (the axis before the vocabulary)."""
    return x.drop_last_position() if isinstance(x, Projected) else x[..., :-1, :]


def _array(x: Any) -> Any:
    return x if isinstance(x, (np.ndarray, Projected)) or is_torch(x) else np.asarray(x)


def _as_rows(x: Any) -> Optional[Any]:
    """x (..., V) as a 2-D (rows, V) view, or None when that needs a copy."""
    if is_torch(x):
        try:
            return x.view(-1, x.shape[-1])
        except RuntimeError:
            return None
    try:
        return np.reshape(x, (-1, x.shape[-1]), copy=False)
    except ValueError:
        return None
    except TypeError:  # numpy < 2.1 has no copy=: reshape only where the strides allow a view
        # (not by assigning a view's shape, which numpy 2.5 deprecates): the
        # leading axes of more than one entry, each a whole step of the one before
        lead = [(n, s) for n, s in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
        if x.size and any(s != n * t for (_, s), (n, t) in zip(lead, lead[1:])):
            return None
        return x.reshape(-1, x.shape[-1])


def row_blocks(z: Any, r: Any = None) -> Iterator[Tuple[Any, Any]]:
    """z (and r, of the same shape, or None) as consecutive 2-D (rows, V)
    views of the same rows, without copying (numpy arrays or tensors)."""
    if z.ndim == 1:
        yield z[None], None if r is None else r[None]
        return
    zz = _as_rows(z)
    rr = None if r is None else _as_rows(r)
    if zz is not None and (r is None or rr is not None):
        yield zz, rr
        return
    for i in range(z.shape[0]):  # not viewable as one block: split the first axis
        yield from row_blocks(z[i], None if r is None else r[i])


def row_chunks(z: Any, r: Any, step: int) -> Iterator[Tuple[slice, Any, Any]]:
    """Consecutive chunks of at most ``step`` rows of z (and r, or None) as
    2-D (rows, V) views, each with the slice of flat row numbers it covers:
    the one row-chunk loop of every backend (mixed dtypes, CUDA memory)."""
    pos = 0
    for zb, rb in row_blocks(z, r):
        for a in range(0, zb.shape[0], step):
            b = min(zb.shape[0], a + step)
            yield slice(pos + a, pos + b), zb[a:b], None if rb is None else rb[a:b]
        pos += zb.shape[0]


class DescribedLogits(Protocol):
    """What the engine reads of a described logits buffer, whichever path
    computes it: `Logits` (the native core) and
    `lmmetrics._engine.cuda.CudaLogits` (torch on a CUDA device)."""

    @property
    def keep(self) -> Any:
        """the array or tensor that owns the memory"""

    @property
    def dtype(self) -> str:
        """float32, float64, float16 or bfloat16"""

    @property
    def lead_shape(self) -> Tuple[int, ...]:
        """the shape without the vocabulary axis"""

    @property
    def n_cols(self) -> int:
        """the vocabulary size"""

    @property
    def n_rows(self) -> int:
        """the number of rows: the product of lead_shape"""


@dataclass
class Logits:
    """A logits buffer as the core sees it: rows of n_cols contiguous values
    (a `DescribedLogits`)."""

    keep: Any  # the array or tensor that owns the memory
    ptr: int
    dtype: str
    lead_shape: Tuple[int, ...]
    n_cols: int
    n_rows: int
    rows_inner: int
    row_stride: int
    outer_stride: int

    @property
    def dtype_code(self) -> int:
        return _core.DTYPES[self.dtype]


def collapse(shape: Sequence[int], strides: Sequence[int]) -> Optional[Tuple[int, int, int, int]]:
    """Leading axes as (n_rows, rows_inner, row_stride, outer_stride), or None
    when they cannot be written with two strides."""
    dims: List[Tuple[int, int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = (dims[-1][0] * n, s)
        else:
            dims.append((n, s))
    if not dims:
        return 1, 1, 0, 0
    if len(dims) == 1:
        return dims[0][0], dims[0][0], dims[0][1], 0
    if len(dims) == 2:
        (no, so), (ni, si) = dims
        return no * ni, ni, si, so
    return None


def as_logits(x: Any, name: str = "logits") -> Logits:
    if type(x) is np.ndarray and x.ndim and x.size and x.flags.c_contiguous and x.flags.aligned:
        dtype = _NAMES.get(x.dtype)  # native byte order only
        if dtype is not None:  # the common case, described directly (what _describe gives)
            shape = x.shape
            n_cols = shape[-1]
            n_rows = x.size // n_cols
            return Logits(x, _core.address(x), dtype, shape[:-1], n_cols, n_rows, n_rows,
                          n_cols if n_rows > 1 else 0, 0)
    if is_torch(x):
        return _torch_logits(x, name)
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    dtype = _dtype_name(a.dtype)
    if dtype not in _NUMPY_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got dtype {a.dtype}")
    if not a.dtype.isnative:  # big-endian on a little-endian machine: one converted copy
        a = a.astype(a.dtype.newbyteorder("="))
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least one axis (..., vocab), got a scalar")
    item = a.itemsize
    if (a.shape[-1] > 1 and a.strides[-1] != item) or any(s % item for s in a.strides):
        a = np.ascontiguousarray(a)
    if not a.flags.aligned:  # e.g. a field of a packed record: the core reads whole elements
        a = a.copy()
    strides = tuple(s // item for s in a.strides[:-1])
    return _describe(a, a.__array_interface__["data"][0], dtype, a.shape, strides, False, name)


_TORCH_NAMES: Dict[Any, str] = {}


def _torch_names() -> Dict[Any, str]:
    """torch's float dtypes and their names (made once, on first use)."""
    if not _TORCH_NAMES:
        import torch

        _TORCH_NAMES.update({torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                             torch.bfloat16: "bfloat16"})
    return _TORCH_NAMES


def torch_dtype_name(x: torch.Tensor, name: str) -> str:
    """The dtype name of a torch logits tensor, or TypeError / ValueError."""
    names = _torch_names()
    if x.dtype not in names:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one axis (..., vocab), got a scalar")
    return names[x.dtype]


def torch_values(x: torch.Tensor, name: str) -> torch.Tensor:
    """x detached, its memory holding the values it stands for, for a kernel
    that reads that memory: a negative view (``x.is_neg()``, such as
    ``torch._neg_view(t)``, whose memory holds the values negated) is
    resolved into a copy. A tensor with no memory to read (the meta device)
    is a ValueError, a sparse or nested one a TypeError."""
    if x.is_meta:
        raise ValueError(f"{name} is on the meta device: it holds no values to compute from")
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor: pad it into one")
    if x.layout != _torch_strided():
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {x.layout} tensor: pass its .to_dense()")
    x = x.detach()
    return x.resolve_neg() if x.is_neg() else x


def _torch_strided() -> Any:
    import torch

    return torch.strided


def _torch_logits(x: torch.Tensor, name: str) -> Logits:
    dtype = torch_dtype_name(x, name)
    x = torch_values(x, name)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    if x.data_ptr() % x.element_size():  # (torch.frombuffer at an odd offset: the core reads whole elements)
        x = x.clone()
    if not x.data_ptr() and x.numel():  # (a fake tensor: address 0, which the core refused as an internal error)
        raise ValueError(f"{name} holds no values in memory (its address is 0, as a fake tensor's): pass a "
                         f"tensor with values")
    return _describe(x, x.data_ptr(), dtype, tuple(x.shape), tuple(x.stride()[:-1]), True, name)


def _describe(keep: Any, ptr: int, dtype: str, shape_in: Sequence[int], lead_strides: Sequence[int],
              torch: bool, name: str) -> Logits:
    shape = tuple(int(n) for n in shape_in)
    if shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis (shape {shape})")
    rows = collapse(shape[:-1], lead_strides)
    if rows is None:  # three or more non-mergeable strided axes: one copy
        if torch:
            keep = keep.contiguous()
            ptr = keep.data_ptr()
        else:
            keep = np.ascontiguousarray(keep)
            ptr = keep.__array_interface__["data"][0]
        rows = collapse(shape[:-1], _contiguous_strides(shape))
        assert rows is not None  # C-contiguous leading axes merge into one
    n_rows = math.prod(shape[:-1])
    _, rows_inner, row_stride, outer_stride = rows
    return Logits(keep, ptr, dtype, shape[:-1], shape[-1], n_rows, rows_inner,
                  row_stride, outer_stride)


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))[:-1]


_INT64_MAX = np.iinfo(np.int64).max


def as_index_array(x: Any, name: str) -> npt.NDArray[np.integer[Any]]:
    """An integer array (numpy or torch CPU/CUDA) as numpy, or TypeError."""
    if is_torch(x):  # (the dtype checked first: numpy has no bfloat16 to name it)
        x = index_array_or_tensor(x, name).cpu().numpy()
    check_unmasked(x, name, "-100" if name == "targets" else None)
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a


def index_array_or_tensor(x: Any, name: str) -> Any:
    """A torch tensor of integers as it is, wherever it lives (no copy, no
    wait for its device); anything else as `as_index_array` makes it. A
    tensor of another dtype is a TypeError."""
    if is_torch(x):
        if x.dtype.is_floating_point or x.dtype.is_complex or str(x.dtype) == "torch.bool":
            raise TypeError(f"{name} must hold integers, got dtype {str(x.dtype).replace('torch.', '')}")
        return torch_values(x, name)
    return as_index_array(x, name)


def check_targets_shape(shape: Tuple[int, ...], logits: DescribedLogits) -> None:
    """ValueError when targets of this shape do not go with the logits (one
    a row), with a hint for a shift mistake."""
    if shape != logits.lead_shape:
        raise ValueError(
            f"targets shape {shape} does not match the logits shape without its "
            f"vocabulary axis {logits.lead_shape}{_off_by_one(shape, logits.lead_shape)}")


def _first_above(a: npt.NDArray[np.integer[Any]], limit: int) -> Optional[int]:
    """The flat index of the first entry > limit, None when there is none
    (compared in a's own dtype: numpy before 2 compares uint64 with a
    Python integer in float64, where 2^63 equals 2^63 - 1)."""
    if not a.size or limit >= np.iinfo(a.dtype).max:
        return None
    bound = a.dtype.type(limit)
    if a.max() <= bound:
        return None
    return int(np.argmax(a.reshape(-1) > bound))


def as_targets(targets: Any, logits: DescribedLogits, check_range: bool = True,
               ignore_index: int = -100) -> I64Array:
    """Targets as contiguous, aligned int64 of n_rows. With check_range, a counted
    target (neither negative nor ignore_index) >= vocab is a ValueError here
    (the native core checks them itself)."""
    if (type(targets) is np.ndarray and targets.dtype == np.int64 and targets.flags.c_contiguous
            and targets.flags.aligned and targets.shape == logits.lead_shape and not check_range):
        return targets.reshape(-1)  # the common case: nothing to convert or check here
    t = as_index_array(targets, "targets")
    check_targets_shape(t.shape, logits)
    flat = t.reshape(-1)
    if flat.dtype.kind == "u" and flat.dtype.itemsize == 8:  # uint64 would wrap negative (ignored)
        i = _first_above(flat, _INT64_MAX)
        if i is not None:
            raise target_error(flat[i], i, logits.n_cols, logits.lead_shape)
    if check_range and flat.size and flat.max() >= logits.n_cols:
        bad = (flat >= logits.n_cols) & (flat != ignore_index)
        if bad.any():
            i = int(np.argmax(bad))
            raise target_error(flat[i], i, logits.n_cols, logits.lead_shape)
    out = np.ascontiguousarray(flat, dtype=np.int64)
    # e.g. a memory-mapped file's tensor at an odd offset: the core reads
    # whole int64 values, so an aligned copy
    return out if out.flags.aligned else out.copy()

def _off_by_one(targets: Tuple[int, ...], lead: Tuple[int, ...]) -> str:
    """The hint for targets one position off the logits (a shift mistake)."""
    if len(targets) != len(lead) or not lead or targets[:-1] != lead[:-1]:
        return ""
    if targets[-1] == lead[-1] - 1:
        return (": the targets are one position shorter. Targets already shifted (ids[..., 1:]) go with "
                "logits[..., :-1, :]; unshifted ids or Hugging Face labels of the logits' length take shift=True")
    if targets[-1] == lead[-1] + 1:
        return (": the targets are one position longer. Pass targets[..., 1:] with these logits, or the "
                "logits of every position with shift=True")
    return ""


# A table entry (bytes or characters of one token) above this is refused:
# sums over 2^31 tokens stay within int64.
MAX_TABLE_ENTRY = 2**32 - 1


def as_table(table: Any, n_cols: int, name: str) -> I64Array:
    """A per-token-id count table (bytes or characters) of length n_cols."""
    a = as_index_array(table, name)
    if a.ndim != 1 or a.shape[0] != n_cols:
        raise ValueError(
            f"{name} must be a 1-D table of length {n_cols} (the vocabulary size), "
            f"got shape {a.shape}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name} holds a negative count at token id {int(np.argmin(a))}")
    i = _first_above(a, MAX_TABLE_ENTRY)
    if i is not None:
        raise ValueError(f"{name} holds {int(a[i])} at token id {i}: a count must be at most "
                         f"{MAX_TABLE_ENTRY}")
    return a.astype(np.int64, copy=False)
