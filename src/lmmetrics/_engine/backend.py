"""Plain logits (arrays and tensors, no lazy ones) to the backend that owns
where they live: the Triton kernel or torch for CUDA tensors
(:mod:`lmmetrics._engine.cuda`), the native core for host buffers
(:mod:`lmmetrics._engine.native`). Called with checked options by
:func:`lmmetrics._engine.run` and, a chunk at a time, by the lazy-logits loop
(:mod:`lmmetrics._engine.chunked`)."""
from __future__ import annotations

from typing import Any

from . import cuda, inputs, native
from .request import RowResults, Want, allocate


def compute(logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int,
            want: Want) -> RowResults:
    """One pass over plain logits (and reference logits) computing ``want``;
    ``ignore``, ``cap`` and ``threads`` as the checks return them."""
    if inputs.is_cuda(logits) or inputs.is_cuda(reference):  # a GPU backend: Triton, else torch
        c_lg = cuda.describe(logits)
        c_ref = None if reference is None else cuda.describe(reference, "reference_logits")
        out = allocate(c_lg, c_ref, targets, ignore, check_range=True, want=want)
        if c_lg.n_rows:
            cuda.compute(c_lg, c_ref, out, ignore, cap)
        return out
    lg = inputs.as_logits(logits)
    ref = None if reference is None else inputs.as_logits(reference, "reference_logits")
    out = allocate(lg, ref, targets, ignore, check_range=False, want=want)
    if lg.n_rows:
        native.compute(lg, ref, out, cap, threads)
    return out
