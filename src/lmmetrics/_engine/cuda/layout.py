"""The GPU result buffer's contract, the one home of what the CUDA path, the
Triton kernel and the lazy-logits loop share: the descriptor of a CUDA
logits tensor (`CudaLogits`), the buffer's rows (`RES_FLAGS`,
then the outputs in ``OUTPUTS``' order: `row`), the flag bits, and the
chunk setting (`set_cuda_chunk_bytes`). A leaf: it imports nothing of
the CUDA path."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..checks import check_positive_int
from ..inputs import collapse
from ..request import OUTPUTS

_DEFAULT_CHUNK_BYTES = 256 * 2**20
_chunk_bytes = _DEFAULT_CHUNK_BYTES


def chunk_bytes() -> int:
    """The current bound on extra GPU memory (`set_cuda_chunk_bytes`)."""
    return _chunk_bytes


def set_cuda_chunk_bytes(nbytes: Optional[int] = None) -> int:
    """Bound the extra GPU memory used for CUDA logits (default 256 MiB).

    Rows are processed in chunks whose temporaries fit in ``nbytes``; at
    least one row is processed at a time. ``None`` restores the default.
    Returns the previous value.
    """
    global _chunk_bytes
    new = _DEFAULT_CHUNK_BYTES if nbytes is None else check_positive_int("nbytes", nbytes)
    old, _chunk_bytes = _chunk_bytes, new
    return old


@dataclass
class CudaLogits:
    """A CUDA logits tensor as the engine sees it."""

    keep: Any
    dtype: str
    lead_shape: Tuple[int, ...]
    n_cols: int
    n_rows: int
    # flat row g lies at element (g // inner) * outer + (g % inner) * stride
    # of keep (two strides: a [..., :-1, :] view stays one view; `rows_of`)
    rows: Tuple[int, int, int] = (1, 0, 0)


def rows_of(x: Any, lead: int) -> Tuple[Any, Tuple[int, int, int]]:
    """A tensor's rows (its first lead axes) as `CudaLogits.rows` describes
    them, (inner, stride, outer), with the tensor: x itself, or a
    contiguous copy when no two strides describe them (three or more
    leading axes that do not merge)."""
    rows = collapse(x.shape[:lead], x.stride()[:lead])
    if rows is None:
        x = x.contiguous()
        rows = collapse(x.shape[:lead], x.stride()[:lead])
        assert rows is not None  # C-contiguous leading axes merge into one
    return x, rows[1:]


# The per-row results of a pass, on the device: one float64 buffer of
# (N_RESULTS, rows), allocated once a pass; row RES_FLAGS holds a row's
# flags, rows 1.. the outputs in OUTPUTS' order (the integer ones as exact
# float64 integers), row RES_TARGETS the targets as the pass read them
# (exact below 2^53: a counted row's is below the vocabulary size, or it
# is an error that reads its target from the device again). The Triton
# kernel writes the same layout.
RES_FLAGS = 0
RES_TARGETS = 1 + len(OUTPUTS)
N_RESULTS = 2 + len(OUTPUTS)
# flag bits: a counted row with F_NAN, F_EMPTY, F_NAN_REF or F_EMPTY_REF is
# an error (the first one raises, checked in that order); one with F_INF,
# F_INF_REF, F_CROSS (the Triton kernel's) or F_REDO (a torch chunk the fast
# path cannot certify) is done again by the exact path. F_COUNTED marks the
# rows with targets that are counted (neither negative nor ignore_index:
# targets stay on the device, the pass says which rows count); F_OOB a
# counted row whose target is not below the vocabulary size (not read; an
# error, named in row order with the logits' errors, as the core names them)
F_NAN, F_INF, F_NAN_REF, F_INF_REF, F_CROSS, F_EMPTY, F_EMPTY_REF, F_REDO = 1, 2, 4, 8, 16, 32, 64, 128
F_COUNTED, F_OOB = 256, 512
ERRORS = F_NAN | F_EMPTY | F_NAN_REF | F_EMPTY_REF
SLOW = F_INF | F_INF_REF | F_CROSS | F_REDO
# the flags a span of the Triton kernel sets (its low bits, in this order)
SPAN_FLAGS = (F_NAN, F_INF, F_NAN_REF, F_INF_REF, F_CROSS)


def row(name: str) -> int:
    """The buffer's row of the per-row output ``name`` (one of ``OUTPUTS``)."""
    return 1 + OUTPUTS.index(name)
