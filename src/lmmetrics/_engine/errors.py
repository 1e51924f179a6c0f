"""The exceptions for bad rows and targets, shared by the native core's path
(`lmmetrics._engine.native`) and the CUDA path (`lmmetrics._engine.cuda`)."""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from .._core import lm_status as Status

__all__ = ["Status", "ROW_STATUSES", "RowError", "position", "row_error", "target_error"]

_ROW_MESSAGES = {
    Status.LM_ERR_NAN: "NaN in logits at row {row} (position {pos})",
    Status.LM_ERR_NAN_REF: "NaN in reference_logits at row {row} (position {pos})",
    Status.LM_ERR_EMPTY: "logits row {row} (position {pos}) is all -inf: it holds no distribution",
    Status.LM_ERR_EMPTY_REF: "reference_logits row {row} (position {pos}) is all -inf: it holds no distribution",
}
ROW_STATUSES = frozenset(_ROW_MESSAGES)


def position(i: int, lead_shape: Sequence[int]) -> Tuple[int, ...]:
    """The index of flattened row i in the logits' leading shape."""
    return tuple(int(k) for k in np.unravel_index(i, tuple(lead_shape))) if lead_shape else ()


class RowError(ValueError):
    """A bad row (NaN, or all -inf, in either buffer): a ValueError whose
    message names the row; ``status`` and ``row`` say which, so that a pass
    over some rows of a larger input can name the row in the input."""

    def __init__(self, status: int, row: int, lead_shape: Sequence[int]) -> None:
        super().__init__(_ROW_MESSAGES[Status(status)].format(row=row, pos=position(row, lead_shape)))
        self.status, self.row = Status(status), row


def row_error(status: int, row: int, lead_shape: Sequence[int]) -> RowError:
    """The exception for a bad row: NaN, or all -inf, in either buffer."""
    return RowError(status, row, lead_shape)


def target_error(value: int, i: int, n_cols: int, lead_shape: Sequence[int]) -> ValueError:
    """The exception for a counted target outside [0, n_cols)."""
    return ValueError(f"target {int(value)} at position {position(i, lead_shape)} is out of "
                      f"range for a vocabulary of {n_cols}")
