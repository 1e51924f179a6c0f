"""The torch path for CUDA tensors: the same per-row quantities as the native
core, computed by torch on the tensor's device, a bounded chunk of rows at a
time (`_compute_torch`, where `lmmetrics._engine.cuda.launch` does not take
the Triton kernel), and the exact path (`_chunk_exact`). Each chunk goes
through one fused ``log_softmax`` into float32 (float64 stays float64) and
is reduced to per-row values, written into one float64 buffer on the
device allocated for the pass (`layout.N_RESULTS` values a row): no chunk
waits for the device. The values asked for cross to the host once, when the
pass ends (`lmmetrics._engine.cuda.settle`), where the sums are taken in float64. A chunk
where a counted row's value is not finite is done again, after that
transfer, by the exact path (logsumexp per side, in float64). The
semantics are the native core's: ignored rows are not checked and get 0 / -1,
the rank counts the logits above the target's and those tied with it at a
lower index, so that rank 0 is the first argmax (compared as torch holds them:
the logits' own dtype, or the capped values in float32 / float64 with a
softcap, ``torch.tanh``: within a few ulps of the core's capped values, so
a near-tie may count differently), the top token's log-probability is the
row's largest log-probability,
NaN or an all -inf row among the counted rows is an error, +inf logits share
the probability mass equally.

Accuracy: that of torch's own float32 ``log_softmax`` (float64 logits stay
float64), not the native core's 2e-6: on CPU-run tensors with V = 128256,
per-token NLL and KL came within 1.4e-5 of float64 and entropy within
5.3e-5; the tests hold it to 3e-5 and 1e-4 (``test_cuda_path``). The Triton
kernel, the default on a GPU, meets the core's 2e-6.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import numpy as np

from ..inputs import row_chunks
from ..request import INDEX_OUTPUTS, RowResults
from ..types import I64Array
from .layout import F_EMPTY, F_EMPTY_REF, F_NAN, F_NAN_REF, F_REDO, RES_FLAGS, CudaLogits, chunk_bytes, row

if TYPE_CHECKING:
    import torch

# float32 temporaries of one row's length that one chunk row may hold at
# once on the fast path: log-probabilities (NLL); with p and p log p
# (entropy); both sides' (KL); on top, a 16-bit side's float copy, and a
# softcap's float copy and tanh.
_TEMPS_NLL = 1
_TEMPS_ROW = 5
_TEMPS_REF = 9
_TEMPS_CAST = 1
_TEMPS_CAP = 2


def _side(x: torch.Tensor, cap: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits (capped in the compute dtype, as the fast path caps them)
    in float64, less their row max (in float32 a logit 3e38 below a row max
    of 3e38 would be -inf there: the native core's float64 gives the
    finite NLL), the logsumexp of those per row (shifted first: logsumexp
    of a row of -1e30 rounds the log of the sum away), and the rows holding
    NaN and all -inf.
    Rows holding +inf become 0 at the +inf entries and -inf elsewhere (equal
    shares), by arithmetic on every row: asking which rows hold +inf would
    wait for the device."""
    import torch

    z = _capped(x, cap).double()
    m = z.amax(1, keepdim=True)  # NaN where a row holds one (amax propagates NaN), else +inf where one holds +inf
    nan = torch.isnan(m[:, 0])
    # less the max, +inf too: then a row's +inf entries (inf - inf) are its
    # only NaN, which become 0 (a NaN row's too: nan has said so already)
    z = z - torch.where(torch.isnan(m) | (m == -math.inf), 0.0, m)
    z.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
    lse = torch.logsumexp(z, 1)
    return z, lse, nan, lse == -math.inf


def _compute_torch(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, res: torch.Tensor,
                   tgt_all: Optional[torch.Tensor], cap: float) -> None:
    """The torch path's chunks, their values into res (nothing waits for
    the device)."""
    import torch

    temps = (_TEMPS_REF if ref is not None else
             _TEMPS_ROW if out.entropy is not None or out.argmax is not None or out.rank is not None
             else _TEMPS_NLL)
    temps += sum(_TEMPS_CAST for x in (lg, ref) if x is not None and x.dtype in ("float16", "bfloat16"))
    temps += _TEMPS_CAP if cap else 0
    temps *= 1 if _fast(out, ref is not None) else 2  # the exact path's temporaries: float64
    step = max(1, chunk_bytes() // (lg.n_cols * 4 * temps))
    counted_all = torch.ones(lg.n_rows, dtype=torch.bool, device=lg.keep.device) if tgt_all is None else tgt_all >= 0
    for rows, zc, rc in row_chunks(lg.keep, None if ref is None else ref.keep, step):
        _chunk(zc, rc, None if tgt_all is None else tgt_all[rows], counted_all[rows], out, res[:, rows], cap)


def _chunk(x: torch.Tensor, r: Optional[torch.Tensor], tgt: Optional[torch.Tensor], counted: torch.Tensor,
           out: RowResults, res: torch.Tensor, cap: float) -> None:
    """One chunk of rows into res (its columns): the fast path from
    log-probabilities (one fused log_softmax a side); a chunk where a
    counted row's value is not finite (NaN, an all -inf row, +inf logits,
    or a target at -inf) has its counted rows flagged F_REDO, done again
    by the exact path after the pass (`compute`), which shares +inf
    mass and names the bad row. The values certify a side's rows when one
    of them is that side's NLL, entropy or KL (a row's NaN or +inf reaches
    all of them); argmax alone certifies nothing and takes the exact path
    (nor does the rank; the top log-probability certifies like the NLL)."""
    import torch

    if not _fast(out, r is not None):
        _chunk_exact(x, r, tgt, counted, out, res, cap)
        return
    safe = _safe_targets(tgt, counted)
    z = _capped(x, cap)
    logp = torch.log_softmax(z, 1, dtype=_compute_dtype(x))
    vals: Dict[str, torch.Tensor] = {}
    if out.nll is not None:
        vals["nll"] = _nonneg(-logp.gather(1, _need(safe))[:, 0].double())
    if out.entropy is not None:
        vals["entropy"] = _entropy(logp)
    if out.argmax is not None:
        vals["argmax"] = torch.argmax(z, 1)
    if out.rank is not None:
        vals["rank"] = _rank(z, _need(safe))
    if out.top_logprob is not None:
        vals["top_logprob"] = logp.amax(1).double()
    del z
    if r is not None:
        rz = _capped(r, cap)
        rlogp = torch.log_softmax(rz, 1, dtype=_compute_dtype(r))
        if out.ref_nll is not None:
            vals["ref_nll"] = _nonneg(-rlogp.gather(1, _need(safe))[:, 0].double())
        if out.kl is not None:
            vals["kl"] = _kl(rlogp, logp)
        if out.ref_argmax is not None:
            vals["ref_argmax"] = torch.argmax(rz, 1)
        del rz, rlogp
    del logp
    certified = counted
    for k, v in vals.items():
        _put(res, counted, k, v)
        if k not in INDEX_OUTPUTS:
            certified = certified & torch.isfinite(v)
    # the whole chunk again when one of its counted rows is not certified:
    # a 0-dim tensor on the device, read by no one until the pass ends
    redo = (counted & ~certified).any()
    res[RES_FLAGS] = torch.where(counted & redo, float(F_REDO), 0.0)


def _fast(out: RowResults, has_ref: bool) -> bool:
    """Whether the fast path's values certify the rows of a pass asking for
    out's outputs (see `_chunk`)."""
    return ((out.nll is not None or out.entropy is not None or out.top_logprob is not None)
            and (not has_ref or out.ref_nll is not None or out.kl is not None))


def _put(res: torch.Tensor, counted: torch.Tensor, name: str, values: torch.Tensor) -> None:
    """The output name of a chunk's rows into its row of res: values where a
    row is counted, else 0 (-1 for the integer outputs)."""
    import torch

    fill = -1.0 if name in INDEX_OUTPUTS else 0.0
    res[row(name)] = torch.where(counted, values.double(), fill)


def count_before(z: torch.Tensor, zt: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Per row the number of values of z that rank before a target of value
    zt (rows, 1) at column at (rows, 1; outside z where the target lies in
    another block of its row): those above it, and those equal to it at a
    lower column (the first argmax's order: the rank's rule)."""
    import torch

    counted = z == zt  # in place from here: three bytes a logit at most
    counted &= torch.arange(z.shape[1], device=z.device)[None, :] < at
    counted |= z > zt
    return counted.sum(1)


def _rank(z: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """Per row the number of values of z that rank before the target's
    (rank 0 exactly where ``torch.argmax`` is the target). z as given: the
    capped logits, or the logits in their own dtype."""
    return count_before(z, z.gather(1, safe), safe)


def _safe_targets(tgt: Optional[torch.Tensor], counted: torch.Tensor) -> Optional[torch.Tensor]:
    """The targets as a (rows, 1) index, 0 where a row is not counted."""
    import torch

    return torch.where(counted, tgt, 0)[:, None] if tgt is not None else None


def _need(x: Optional[torch.Tensor]) -> torch.Tensor:
    """x, computed when a path reads it (an NLL has targets, the KL the
    model's log-probabilities)."""
    if x is None:
        raise RuntimeError("lmmetrics: internal error: a CUDA chunk lacks what it reads")
    return x


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p a row: entr(p) = -p ln p is 0 at p = 0 (masked entries)
    and NaN at NaN; ln of the rounded p costs 6e-8 at most."""
    import torch

    entropy: torch.Tensor = torch.special.entr(torch.exp(logp)).sum(1, dtype=torch.float64)
    return entropy


# ln of float64's least positive number: a reference log-probability above
# it is a positive probability in float64
_F64_LOG_TINY = math.log(5e-324) - math.log(2)


def _kl(rlogp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) a row from log P (the reference) and log Q, as the native
    core computes it: entries with no reference mass add nothing; reference
    mass where the model has none (log Q = -inf) makes the row inf wherever
    float64 holds that mass (the term underflows in float32 far sooner); a
    NaN in log P (NaN, +inf or all -inf reference logits) stays NaN, so the
    row is certified by the exact path, never counted as 0."""
    import torch

    pr = torch.exp(rlogp)
    terms = torch.where(pr > 0, pr * (rlogp - logp), 0.0)
    terms = torch.where((logp == -math.inf) & (rlogp > _F64_LOG_TINY), math.inf, terms)
    terms = torch.where(torch.isnan(rlogp), math.nan, terms)
    return _nonneg(terms.sum(1, dtype=torch.float64))


def _nonneg(v: torch.Tensor) -> torch.Tensor:
    """v, 0 where rounding made it negative (NaN stays NaN)."""
    import torch

    return torch.where(v < 0, 0.0, v)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for every logits dtype but float64 (exact conversions)."""
    import torch

    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """The softcapped logits c tanh(x / c) in the compute dtype, or x as given
    (capping keeps the order: the argmax is taken on these)."""
    import torch

    return torch.tanh(x.to(_compute_dtype(x)) / cap) * cap if cap else x


def _chunk_exact(x: torch.Tensor, r: Optional[torch.Tensor], tgt: Optional[torch.Tensor], counted: torch.Tensor,
                 out: RowResults, res: torch.Tensor, cap: float) -> None:
    """One chunk by the exact path into res (its columns): the outputs out
    asks for, and the flags of the counted rows that are errors (NaN, all
    -inf), which `settle` raises for once the flags are on the
    host."""
    import torch

    z, lse, nan, empty = _side(x, cap)
    flags = torch.where(nan, F_NAN, 0) | torch.where(empty, F_EMPTY, 0)
    if r is not None:
        rz, rlse, rnan, rempty = _side(r, cap)
        flags = flags | torch.where(rnan, F_NAN_REF, 0) | torch.where(rempty, F_EMPTY_REF, 0)
    res[RES_FLAGS] = torch.where(counted, flags, 0).double()

    def put(name: str, values: torch.Tensor) -> None:
        if getattr(out, name) is not None:
            _put(res, counted, name, values)

    safe = _safe_targets(tgt, counted)
    if out.nll is not None:
        put("nll", (lse - z.gather(1, _need(safe))[:, 0]).double())
    logp = None
    if out.entropy is not None or out.kl is not None:
        logp = z - lse[:, None]
        if out.entropy is not None:
            put("entropy", _entropy(logp))
    if out.argmax is not None:
        put("argmax", torch.argmax(z, 1))
    if out.rank is not None:  # on the capped logits, not z less its max (which may round ties in)
        put("rank", _rank(_capped(x, cap), _need(safe)))
    if out.top_logprob is not None:
        put("top_logprob", (z.amax(1) - lse).double())
    if r is None:
        return
    if out.ref_nll is not None:
        put("ref_nll", (rlse - rz.gather(1, _need(safe))[:, 0]).double())
    if out.ref_argmax is not None:
        put("ref_argmax", torch.argmax(rz, 1))
    if out.kl is not None:
        put("kl", _kl(rz - rlse[:, None], _need(logp)))


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, V) when that is a view, else x itself (rows then are
    taken by their multi-index): never a copy of the whole buffer."""
    if x.dim() == 1:
        return x.unsqueeze(0)
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x


def _take(x2: torch.Tensor, part: I64Array, sel: torch.Tensor) -> torch.Tensor:
    """Rows part of the flattened logits x2 (a copy of those rows only)."""
    if x2.dim() == 2:
        return x2.index_select(0, sel)
    import torch

    lead = x2.shape[:-1]
    return torch.stack([x2[tuple(int(k) for k in np.unravel_index(i, lead))] for i in part])
