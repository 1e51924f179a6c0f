"""The exceptions for bad rows and targets, shared by the native core's path
(`lmmetrics._engine.native`) and the CUDA path (`lmmetrics._engine.cuda`)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .._core import lm_status as Status

__all__ = ["Status", "ROW_STATUSES", "RowError", "TargetError", "let_go", "position", "row_error", "target_error"]

_ROW_MESSAGES = {
    Status.LM_ERR_NAN: "NaN in logits at row {row} (position {pos})",
    Status.LM_ERR_NAN_REF: "NaN in reference_logits at row {row} (position {pos})",
    Status.LM_ERR_EMPTY: "logits row {row} (position {pos}) is all -inf: it holds no distribution",
    Status.LM_ERR_EMPTY_REF: "reference_logits row {row} (position {pos}) is all -inf: it holds no distribution",
}
ROW_STATUSES = frozenset(_ROW_MESSAGES)


_E = TypeVar("_E", bound=BaseException)


def let_go(e: _E) -> _E:
    """e, kept to be raised again later, without the tracebacks of it and
    of the errors it was raised from or while handling: their frames hold
    what the pass read (its closure: a batch of logits), as long as e is
    kept. Raised again, it has the traceback of where it is raised."""
    seen = set()
    at: Optional[BaseException] = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        at.__traceback__ = None
        at = at.__cause__ or at.__context__
    return e


def position(i: int, lead_shape: Sequence[int]) -> Tuple[int, ...]:
    """The index of flattened row i in the logits' leading shape."""
    return tuple(int(k) for k in np.unravel_index(i, tuple(lead_shape))) if lead_shape else ()


class RowError(ValueError):
    """A bad row (NaN, or all -inf, in either buffer): a ValueError whose
    message names the row; ``status`` and ``row`` (flattened, in the pass)
    say which, so that a pass over some rows of a larger input can name the
    row in the input. ``shifted``: the pass read ``logits[..., :-1, :]``
    (``shift=True``), and the message names the row in the logits given."""

    def __init__(self, status: int, row: int, lead_shape: Sequence[int], shifted: bool = False) -> None:
        lead = tuple(int(n) for n in lead_shape)
        shown, given = row, lead
        if shifted and lead:  # (the same position, in logits with one more position a sequence)
            shown = row // lead[-1] * (lead[-1] + 1) + row % lead[-1] if lead[-1] else row
            given = lead[:-1] + (lead[-1] + 1,)
        super().__init__(_ROW_MESSAGES[Status(status)].format(row=shown, pos=position(shown, given)))
        self.status, self.row, self.lead_shape, self.shifted = Status(status), row, lead, shifted

    def __reduce__(self) -> Tuple[Any, ...]:  # (pickled whole: a process pool re-raises it)
        return RowError, (int(self.status), self.row, self.lead_shape, self.shifted)

    def unshifted(self) -> RowError:
        """The same error named in the logits given (the pass read
        ``logits[..., :-1, :]``)."""
        return RowError(self.status, self.row, self.lead_shape, True)


def row_error(status: int, row: int, lead_shape: Sequence[int]) -> RowError:
    """The exception for a bad row: NaN, or all -inf, in either buffer."""
    return RowError(status, row, lead_shape)


class TargetError(ValueError):
    """A counted target outside [0, n_cols): a ValueError whose message names
    the target's position in the targets; ``value``, ``row`` (flattened, in
    the pass), ``n_cols`` and ``lead_shape`` say which, so that a pass over
    aligned views (``shift=True``) can name the position in the input
    (``shifted``: the pass read ``targets[..., 1:]``, and the message names
    the position in the targets given, one on)."""

    def __init__(self, value: int, row: int, n_cols: int, lead_shape: Sequence[int], shifted: bool = False) -> None:
        pos = position(row, lead_shape)
        if shifted:
            pos = pos[:-1] + (pos[-1] + 1,)
        super().__init__(f"target {int(value)} at position {pos} is out of range for a vocabulary of {n_cols}")
        self.value, self.row, self.n_cols, self.lead_shape = int(value), row, n_cols, tuple(lead_shape)
        self.shifted = shifted

    def __reduce__(self) -> Tuple[Any, ...]:  # (pickled whole: a process pool re-raises it)
        return TargetError, (self.value, self.row, self.n_cols, self.lead_shape, self.shifted)

    def unshifted(self) -> TargetError:
        """The same error named at the target's position in the unshifted
        targets (the pass read ``targets[..., 1:]``)."""
        return TargetError(self.value, self.row, self.n_cols, self.lead_shape, True)


def target_error(value: int, i: int, n_cols: int, lead_shape: Sequence[int]) -> TargetError:
    """The exception for a counted target outside [0, n_cols)."""
    return TargetError(value, i, n_cols, lead_shape)
