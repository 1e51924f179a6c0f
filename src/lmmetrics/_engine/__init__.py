"""The one path from the public functions to a computation.

Every metric calls `run`, which checks the arguments, takes model
outputs' ``.logits``, aligns unshifted inputs (``shift=True``) and hands
the pass to `lmmetrics._engine.backend.compute`, which allocates the
per-row outputs (`lmmetrics._engine.request`) and calls the backend
that owns where the data lives: the native core for host buffers
(`lmmetrics._engine.native`), the Triton kernel or torch for CUDA
tensors (`lmmetrics._engine.cuda`). Lazy logits
(`lmmetrics._engine.lazy`) go to `lmmetrics._engine.chunked`,
which passes their chunks to the same backend. Data flows one way: no
module of this package imports one above it (``tests/package/test_layers.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from . import cuda as _cuda
from . import native as _native
from . import inputs as _inputs
from .backend import compute
from .checks import check_ignore_index as check_ignore_index
from .checks import check_positive_int as check_positive_int
from .checks import check_shift as check_shift
from .checks import check_softcap as check_softcap
from .checks import check_threads as check_threads
from .chunked import run_lazy
from .errors import RowError, TargetError
from .errors import let_go as let_go
from .inputs import is_torch, model_logits, shifted
from .lazy import Projected
from .request import RowResults as RowResults
from .request import Want, want_of


def run(logits: Any, targets: Any = None, reference: Any = None, *, ignore_index: Optional[int] = -100,
        softcap: Optional[float] = None, num_threads: Optional[int] = None, shift: Optional[bool] = None,
        defer: bool = False, **outputs: bool) -> RowResults:
    """One read of the logits (and reference logits) computing the outputs
    asked for (``nll=True``, ... : the names of ``request.REQUESTS``).

    ``rank`` (needs targets): per row the number of logits above the
    target's, plus those equal to it at a lower index (int64, -1 where
    ignored; 0 exactly where the first argmax is the target); ``top_logprob``: the top token's
    log-probability, max - logsumexp (0.0 where ignored). Neither costs
    anything when not asked.

    ``logits`` and ``reference`` may be model outputs with ``.logits``;
    with ``shift`` they are aligned with the next target (`shifted`).
    ``defer``: a pass over CUDA tensors is launched and not waited for; the
    results are there (and its errors raised) at `RowResults.finish`."""
    want = want_of(outputs)
    threads = check_threads(num_threads)
    cap = check_softcap(softcap)
    ignore = check_ignore_index(ignore_index)
    said = check_shift(shift)
    if said is None and targets is not None and (type(logits) is not np.ndarray or reference is not None):
        _shift_must_be_said(logits, reference)  # (without targets, entropy and KL, nothing to align)
    logits, reference = model_logits(logits), model_logits(reference, "reference_logits")
    if said:
        logits, targets, reference = shifted(logits, targets, reference)
    if ("kl" in want or "ref_nll" in want) and reference is None:
        raise ValueError("reference_logits are required for the KL divergence")
    if not said:
        return _pass(logits, targets, reference, ignore, cap, threads, want, defer)
    out: RowResults = _unshifted(lambda: _pass(logits, targets, reference, ignore, cap, threads, want, defer))
    pending = out.pending
    if pending is not None:  # (a deferred pass raises when it completes)
        out.pending = lambda res: _unshifted(lambda: pending(res))
    return out


def _pass(logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int, want: Want,
          defer: bool) -> RowResults:
    if isinstance(logits, Projected) or isinstance(reference, Projected):
        return run_lazy(logits, targets, reference, ignore, cap, threads, want)
    return compute(logits, targets, reference, ignore, cap, threads, want, defer)


def _unshifted(work: Callable[[], Any]) -> Any:
    """work() over shifted inputs, a bad row or target it raises named where
    it is in the unshifted inputs."""
    try:
        return work()
    except (RowError, TargetError) as e:
        raise e.unshifted() from None


def nll_total(logits: Any, targets: Any, *, ignore_index: Optional[int], shift: Optional[bool],
              softcap: Optional[float], num_threads: Optional[int]) -> Optional[Tuple[float, int]]:
    """(NLL sum, tokens counted) of the commonest call, C-contiguous float32 /
    float64 / float16 logits (numpy, or a torch CPU tensor) and int64
    targets of their leading shape, without softcap or shift: the native
    core's job from the compiled binding, with no per-row output allocated.
    None for any other call, and for one the core finds a bad row or target
    in: the caller then takes `run` (cross_entropy's fixed cost on one
    row, 4 us, was mostly this layer). The options are checked as run()
    checks them."""
    if softcap is not None:
        return None
    z, t = _host_array(logits), _host_array(targets)
    if z is None or t is None:
        return None
    threads, ignore = check_threads(num_threads), check_ignore_index(ignore_index)
    if check_shift(shift):
        return None
    return _native.nll_total(z, t, ignore, threads)


def device_nll_total(out: RowResults, of: Callable[[Any, Any], Any]) -> Any:
    """of(NLL sum, tokens counted) of a pass launched on a device with
    defer, over 0-d tensors there, queued with no wait on the pass's stream
    (`cuda.device_total`: the sum NaN where the host's results will name an
    error or redo a row); None for a pass done in the call (numpy, CPU
    tensors, lazy logits: its results are on the host)."""
    return None if out.on_device is None else _cuda.device_total(out.on_device, "nll", of)


def _host_array(x: Any) -> Optional[np.ndarray[Any, Any]]:
    """x for a numpy array, a torch CPU tensor as a numpy view; None for
    anything else (or a tensor numpy cannot view: bfloat16, sparse)."""
    if type(x) is np.ndarray:
        return x
    if not is_torch(x) or _inputs.is_cuda(x):  # (is_cuda: where run() sends a tensor)
        return None
    try:
        view: np.ndarray[Any, Any] = x.detach().numpy() if x.requires_grad else x.numpy()
    except (RuntimeError, TypeError):
        return None
    return view


def _shift_must_be_said(*inputs: Any) -> None:
    """A model output (``.logits``) or a model's lazy logits come with the
    ids the model read, unshifted by nature: without shift=True / False the
    targets could be either, and a guess is a plausible wrong number."""
    for x in inputs:
        if x is None or isinstance(x, np.ndarray) or is_torch(x):
            continue
        if isinstance(x, Projected) and not x.from_model:
            continue
        if isinstance(x, Projected) or hasattr(x, "logits"):
            what = "lmmetrics.model_logits()" if isinstance(x, Projected) else f"a model output ({type(x).__name__})"
            if hasattr(x, "encoder_last_hidden_state"):  # (transformers' Seq2SeqLMOutput and its kind)
                # its decoder reads the labels shifted right: "shift=True for labels" would be a wrong number
                raise ValueError(
                    f"the logits come from an encoder-decoder model's output ({type(x).__name__}), whose "
                    f"decoder reads its labels shifted right (position t predicts labels[..., t]): say "
                    f"shift=False when the targets are its labels, or shift=True when they are its "
                    f"decoder_input_ids (position t predicts targets[..., t + 1]); Evaluator and the "
                    f"torchmetrics classes take shift= in their constructor")
            raise ValueError(
                f"the logits come from {what}: say shift=True when the targets are the model's input ids (-100 "
                f"where padded) or Hugging Face labels (position t predicts targets[..., t + 1]), or shift=False when they "
                f"are already aligned with the logits (position t predicts targets[..., t]); Evaluator and "
                f"the torchmetrics classes take shift= in their constructor")


