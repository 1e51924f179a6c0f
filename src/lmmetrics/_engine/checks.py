"""Argument checks shared by every module (no native core, no torch):
each returns the value in the form the engine uses, or raises a clear
TypeError / ValueError naming the argument."""
from __future__ import annotations

import numbers
import operator
from typing import Optional

import numpy as np

MAX_THREADS = 1024
# The kernel applies a softcap in float lanes (c and 1 / c): both must be
# normal float32 numbers with room to spare.
SOFTCAP_RANGE = (1e-30, 1e30)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_positive_int(name: str, value: object) -> int:
    """value as an int when it is an integer (Python or numpy, not a bool)
    of at least 1, else ValueError: the one check of a count, a length or a
    size that must be positive."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_token_id(name: str, value: object, what: str = "an integer token id") -> int:
    """value as a token id, an integer >= 0 (anything with ``__index__``;
    a bool is the caller's to refuse or read, a boolean tensor or array is
    refused), else TypeError saying it must be ``what``, or ValueError for a
    negative one."""
    if str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):  # (its __index__ reads it as token 0 or 1)
        raise TypeError(f"{name} must be {what}, got {value!r}, a boolean")
    try:
        i = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {value!r}") from None
    if i < 0:
        raise ValueError(f"{name} must be a token id (>= 0), got {i}")
    return i


def check_threads(num_threads: object) -> int:
    """0 for None (the OpenMP default), else the thread count, or ValueError."""
    if num_threads is None:
        return 0
    if (isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer))
            or not 1 <= num_threads <= MAX_THREADS):
        raise ValueError(f"num_threads must be an integer from 1 to {MAX_THREADS}, or None; "
                         f"got {num_threads!r}")
    return int(num_threads)


def check_softcap(softcap: object) -> float:
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


def check_ignore_index(ignore_index: object) -> int:
    """The ignore_index as an int64 value (None: -1, as negative targets are
    ignored anyway), or TypeError / ValueError."""
    if ignore_index is None:
        return -1
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an integer or None, got {ignore_index!r}")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index!r}")
    return int(ignore_index)


def check_shift(shift: object) -> Optional[bool]:
    """shift as a bool, None when it was not said (the engine decides
    whether it must be), else TypeError."""
    if shift is None:
        return None
    if not isinstance(shift, (bool, np.bool_)):
        raise TypeError(f"shift must be True or False, got {shift!r}")
    return bool(shift)
