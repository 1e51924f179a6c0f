"""Type stub of the native core (lmmetrics_c/_core.pyx): its Python-visible
API only. Keep it in step with the .pyx."""
from enum import IntEnum
from typing import Any, Dict, Optional, Tuple

import numpy as np
import numpy.typing as npt

class lm_status(IntEnum):
    LM_OK = 0
    LM_ERR_NAN = 1
    LM_ERR_NAN_REF = 2
    LM_ERR_EMPTY = 3
    LM_ERR_EMPTY_REF = 4
    LM_ERR_ARGS = 5
    LM_ERR_NOMEM = 6
    LM_ERR_TARGET = 7
    LM_INTERRUPTED = 8

DTYPES: Dict[str, int]
ISAS: Tuple[str, ...]
CFLAGS: str
OPENMP_BUILD: str
ISAS_BUILT: Tuple[str, ...]

def run(
    *,
    dtype: int,
    n_rows: int,
    n_cols: int,
    rows_inner: int,
    logits: Tuple[int, int, int],
    reference: Optional[Tuple[int, int, int]] = None,
    targets: Optional[npt.NDArray[np.int64]] = None,
    ignore_index: int = -100,
    softcap: float = 0.0,
    outputs: Tuple[Optional[npt.NDArray[Any]], ...] = (),
    num_threads: int = 0,
) -> Tuple[int, int, float, int]:
    """(status, first bad row, NLL sum, rows counted); status is an
    lm_status value as a plain int. outputs: (nll, entropy, argmax, kl,
    ref_argmax, ref_nll, rank, top_logprob), float64 / int64 arrays or None."""

def nll_total(logits: object, targets: object, ignore_index: int, num_threads: int) -> Optional[Tuple[float, int]]:
    """(NLL sum, rows counted) of a plain call (C-contiguous aligned native
    float32 / float64 / float16 logits, int64 targets of their leading
    shape), else None (and None where the core finds a bad row or target)."""

def isa_supported(name: str) -> bool: ...
def address(obj: object) -> int: ...
def set_isa(name: str) -> None: ...
def active_isa() -> str: ...
def best_isa() -> str: ...
def openmp() -> bool: ...
def max_threads() -> int: ...
def read_pass(ptr: int, nbytes: int, num_threads: int = 0, isa: Optional[str] = None,
              prefetch: bool = False) -> int: ...
