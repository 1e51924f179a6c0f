"""Plain logits (arrays and tensors, no lazy ones) to the backend that owns
where they live: the Triton kernel or torch for CUDA tensors
(`lmmetrics._engine.cuda`), the native core for host buffers
(`lmmetrics._engine.native`). Called with checked options by
`lmmetrics._engine.run` and, a chunk at a time, by the lazy-logits loop
(`lmmetrics._engine.chunked`)."""
from __future__ import annotations

from typing import Any, Callable

from . import cuda, inputs, native
from .request import RowResults, Want, allocate


def compute(logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int,
            want: Want, defer: bool = False) -> RowResults:
    """One pass over plain logits (and reference logits) computing ``want``;
    ``ignore``, ``cap`` and ``threads`` as the checks return them. With
    defer, a pass on a CUDA device is launched and left to complete at the
    results' `RowResults.finish` (nothing here waits for the device)."""
    gpu = inputs.is_cuda(logits) or inputs.is_cuda(reference)  # a GPU backend: Triton, else torch
    describe: Callable[[Any, str], Any] = cuda.describe if gpu else inputs.as_logits
    lg = describe(logits, "logits")
    ref = None if reference is None else describe(reference, "reference_logits")
    out = allocate(lg, ref, targets, ignore, check_range=False, want=want, targets_later=gpu)
    if lg.n_rows and gpu:
        out.pending = cuda.compute(lg, ref, out, targets, ignore, cap, defer)
        if not defer:
            out.finish()
    elif lg.n_rows:
        native.compute(lg, ref, out, cap, threads)
    return out
