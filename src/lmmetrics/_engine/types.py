"""Type aliases of the public signatures. Torch appears in annotations
only: at run time the package needs numpy alone."""
from __future__ import annotations

from typing import Any, Optional, Sequence, TypedDict, Union

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating[Any]]  #: float32 or float64 per-position values
F64Array = npt.NDArray[np.float64]
I64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
#: logits the native path reads as numpy: arrays, or nested sequences np.asarray takes
NumpyLogits = Union[npt.NDArray[Any], Sequence[Any]]


class NllOptions(TypedDict, total=False):
    """The keywords of the target-scoring metrics (token_nll, cross_entropy, ...)."""

    ignore_index: Optional[int]
    shift: Optional[bool]
    softcap: Optional[float]
    num_threads: Optional[int]


class RowOptions(TypedDict, total=False):
    """The keywords of the target-free metrics (token_entropy, token_kl, ...)."""

    softcap: Optional[float]
    num_threads: Optional[int]
