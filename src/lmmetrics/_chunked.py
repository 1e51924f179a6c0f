"""Lazy logits through the engine a bounded chunk at a time.

:func:`run_lazy` takes the engine's ``run`` and calls it on plain logits:
the counted rows (every row without targets) in chunks whose logits fit the
budget, each chunk computed (:meth:`lmmetrics._lazy.Projected.rows`), read
and dropped. Where whole rows do not fit the budget 2048 at a time, a chunk
is cut into tiles of rows x a vocabulary block, and the blocks' results are
merged exactly in float64: each block's logsumexp is its NLL at the block's
first column plus that logit, the entropy is the mixture's, the KL weights
each block's by the reference's share, the argmax is the first of the
largest, the top token's log-probability the largest of the blocks' (each
moved by its block's share of the mass), and the rank (the logits above
the target's) the sum of the blocks' counts against the target's logit,
which a first look at each row's target block gives (the block's own value
where the target lies in it). Rows the blocks cannot certify (a block all -inf, +inf logits) are
done again whole, one at a time. Ignored rows are never projected.

On a CUDA device, chunks of whole rows go through the CUDA pass without
waiting for it (:func:`lmmetrics._cuda.launch`); their per-row results stay
on the device and come to the host in one transfer once every chunk is
launched (:func:`_settle`). Vocabulary blocks are merged in numpy: each
block's values come to the host (a transfer a block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from . import _inputs
from ._device import to_device
from ._errors import RowError, Status, row_error
from ._inputs import is_cuda, is_torch
from ._lazy import DEFAULT_CHUNK_BYTES, Projected
from ._request import INDEX_OUTPUTS, OUTPUTS, RowResults, allocate, fsum
from ._types import F64Array, I64Array

#: the engine's run (the chunks' logits are plain: no recursion into this module)
RunFn = Callable[..., RowResults]


@dataclass
class _LazyShape:
    """Lazy logits (or the plain logits beside them) as a DescribedLogits:
    what the checks and the outputs need, no buffer."""

    keep: Any
    dtype: str
    lead_shape: Tuple[int, ...]
    n_cols: int
    n_rows: int


def _lazy_shape(x: Any) -> _LazyShape:
    shape = tuple(int(n) for n in x.shape)
    dtype = x.dtype if isinstance(x, Projected) else str(x.dtype).replace("torch.", "")
    return _LazyShape(x, dtype, shape[:-1], shape[-1], math.prod(shape[:-1]))


# Lazy logits whose whole-vocabulary rows do not fit the chunk budget this
# many at a time are cut into tiles of rows x a vocabulary block: a matmul of
# few rows re-reads the whole head for little work (64 rows ran at 0.4 of the
# full matmul's speed on the host, 2048 rows at its speed); the per-block
# results merge exactly in float64 (_merge_blocks).
_TILE_ROWS = 2048
_MIN_BLOCK = 512


def run_lazy(run: RunFn, logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int,
             want: Dict[str, bool]) -> RowResults:
    """``run`` over lazy logits (either side or both): the counted rows (all
    rows without targets) a bounded chunk at a time, each chunk's logits
    computed, passed through ``run`` as plain logits, and dropped."""
    lg, ref = _lazy_shape(logits), None if reference is None else _lazy_shape(reference)
    if ref is not None and ref.n_cols != lg.n_cols:
        raise ValueError(f"the model's vocabulary ({lg.n_cols}) and the reference's ({ref.n_cols}) differ: "
                         f"a KL divergence needs one vocabulary")
    sides = [x for x in (logits, reference) if x is not None]
    if cap and any(isinstance(x, Projected) and x.softcap for x in sides):
        raise ValueError("softcap is given both to the metric and to projected(): give it once "
                         "(projected()'s applies to those logits only)")
    out = allocate(lg, ref, targets, ignore, check_range=True, **want)
    for name in OUTPUTS:
        arr = getattr(out, name)
        if arr is not None:  # ignored rows: as the core leaves them
            arr.fill(-1 if name in INDEX_OUTPUTS else 0)
    rows = np.flatnonzero(out.counted) if out.targets is not None else np.arange(lg.n_rows)
    lazy = [x for x in sides if isinstance(x, Projected)]
    budget = lazy[0].chunk_bytes or (_cuda_chunk_bytes() if any(is_cuda(x.hidden) for x in lazy)
                                     else DEFAULT_CHUNK_BYTES)
    per_col = sum(x.itemsize if isinstance(x, Projected) else x.dtype.itemsize
                  if isinstance(x, np.ndarray) else x.element_size() for x in sides)
    V = lg.n_cols
    step = max(1, budget // (V * per_col))
    block = V
    if step < min(rows.size, _TILE_ROWS) and V > _MIN_BLOCK:  # tiles of rows x a vocabulary block
        step = max(1, min(rows.size, _TILE_ROWS, budget // (_MIN_BLOCK * per_col)))
        block = max(_MIN_BLOCK, budget // (step * per_col))
    on_device: List[Tuple[I64Array, Any]] = []  # CUDA chunks: their rows and results, on the device
    for a in range(0, rows.size, step):
        sel = rows[a:a + step]
        t = None if out.targets is None else out.targets[sel]
        if block >= V:
            _lazy_rows(run, logits, reference, sel, t, out, lg.lead_shape, cap, threads, want, on_device)
        else:
            _lazy_tiles(run, logits, reference, sel, t, out, lg.lead_shape, block, cap, threads, want)
    if on_device:
        _settle(logits, reference, on_device, out, lg.lead_shape, cap, step)
    out.n_counted = int(rows.size)
    out.nll_sum = fsum(out.nll) if out.nll is not None else 0.0
    return out


def _lazy_rows(run: RunFn, logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
               lead: Tuple[int, ...], cap: float, threads: int, want: Dict[str, bool],
               on_device: Optional[List[Tuple[I64Array, Any]]] = None) -> None:
    """Rows sel, whole, through ``run``; their results into out. CUDA
    logits, given on_device, go through the CUDA pass without waiting for
    the device: sel and the pass's results (on the device) join on_device,
    for :func:`_settle` once every chunk is launched."""
    z = _take_rows(logits, sel, lead)
    r = None if reference is None else _take_rows(reference, sel, lead)
    if on_device is not None and (_inputs.is_cuda(z) or _inputs.is_cuda(r)):
        from . import _cuda

        c_lg = _cuda.describe(z)
        c_ref = None if r is None else _cuda.describe(r, "reference_logits")
        part = allocate(c_lg, c_ref, t, -1, check_range=False, **want)  # (its arrays stay unfilled)
        on_device.append((sel, _cuda.launch(c_lg, c_ref, part, cap)[0]))
        return
    _into(out, sel, lead, lambda: run(z, t, r, ignore_index=-1, softcap=cap or None, num_threads=threads or None,
                                      **want))


def _into(out: RowResults, sel: I64Array, lead: Tuple[int, ...], results: Callable[[], RowResults]) -> None:
    """results() (of rows sel, in order) into out; a bad row it names is
    named as the input's row."""
    try:
        part = results()
    except RowError as e:  # the row in the input, not in the chunk
        raise row_error(e.status, int(sel[e.row]), lead) from None
    for name in OUTPUTS:
        arr = getattr(out, name)
        if arr is not None:
            arr[sel] = getattr(part, name)


def _settle(logits: Any, reference: Any, on_device: List[Tuple[I64Array, Any]], out: RowResults,
            lead: Tuple[int, ...], cap: float, step: int) -> None:
    """The CUDA chunks' results to the host in one transfer, into out (the
    first bad row raises); the rows the pass could not certify done again
    by the exact path, step rows at a time, as the CUDA pass of each chunk
    would have done them. Their logits are computed again (the chunks' are
    gone), from a product of fewer rows: on a GPU the matmul may round
    them a last bit differently, as a change of chunk_bytes would."""
    import torch

    from . import _cuda

    rows = np.concatenate([sel for sel, _ in on_device])
    res = torch.cat([part for _, part in on_device], 1)
    on_device.clear()
    slow = rows[_cuda.settle(res, out, rows, lead)]

    def exact(sel: I64Array) -> RowResults:
        n = sel.size
        lg = _cuda.describe(_take_rows(logits, sel, lead))
        ref = None if reference is None else _cuda.describe(_take_rows(reference, sel, lead), "reference_logits")
        t = None if out.targets is None else out.targets[sel]
        part = out.derived((n,), t, lambda v: np.empty(n, v.dtype))
        _cuda.exact_rows(np.arange(n), lg, ref, part, cap, None if t is None else to_device(t, lg.keep.device))
        return part

    for a in range(0, slow.size, step):
        sel = slow[a:a + step]
        _into(out, sel, lead, lambda: exact(sel))


def _lazy_tiles(run: RunFn, logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                lead: Tuple[int, ...], block: int, cap: float, threads: int, want: Dict[str, bool]) -> None:
    """Rows sel a vocabulary block at a time: each tile through ``run`` with
    every target at the block's first column, which gives the block's
    logsumexp (its NLL plus that logit); the blocks merged in float64. A row
    the blocks cannot certify (a block all -inf, +inf logits) is done again
    whole, alone."""
    V = out.n_cols
    n = sel.size
    ref = reference is not None
    kw = dict(nll=True, entropy=want["entropy"], argmax=want["argmax"], kl=want["kl"], ref_nll=ref,
              top_logprob=want["top_logprob"])
    blocks: Dict[str, List[Any]] = {k: [] for k in ("lse", "ent", "amv", "am", "rlse", "kl", "ramv", "ram", "top")}
    want_rank = want["rank"] and t is not None
    above = np.zeros(n, np.int64)
    thr = _target_logits(logits, sel, _need_targets(t), lead, block, cap) if want_rank else np.zeros(n)
    zt = np.zeros(n)
    rt = np.zeros(n)
    redo = np.zeros(n, bool)
    col0 = np.zeros(n, np.int64)
    for j in range(0, V, block):
        cols = slice(j, min(V, j + block))
        z = _take_rows(logits, sel, lead, cols, cap)
        r = None if not ref else _take_rows(reference, sel, lead, cols, cap)
        try:
            part = run(z, col0, r, ignore_index=-1, num_threads=threads or None, **kw)
        except RowError as e:
            if e.status not in (Status.LM_ERR_EMPTY, Status.LM_ERR_EMPTY_REF):
                raise row_error(e.status, int(sel[e.row]), lead) from None
            _lazy_rows_alone(run, logits, reference, sel, t, out, lead, cap, threads, want)  # a block all -inf
            return
        rows_n = np.arange(n)
        with np.errstate(invalid="ignore"):  # inf + -inf: the row is done again whole
            blocks["lse"].append(part.floats("nll") + _at(z, rows_n, col0))
        if want["entropy"]:
            blocks["ent"].append(part.floats("entropy"))
        if want["argmax"]:
            am = part.indices("argmax")
            blocks["am"].append(am + j)
            blocks["amv"].append(_at(z, rows_n, am))
        if want["top_logprob"]:
            blocks["top"].append(part.floats("top_logprob"))
        if t is not None:
            inb = np.flatnonzero((t >= cols.start) & (t < cols.stop))
            zt[inb] = _at(z, inb, t[inb] - j)
        if want_rank:  # the target's own block: its own value
            thr[inb] = zt[inb]
            above += _count_above(z, thr)
        if ref:
            with np.errstate(invalid="ignore"):
                blocks["rlse"].append(part.floats("ref_nll") + _at(r, rows_n, col0))
            if want["kl"]:
                blocks["kl"].append(part.floats("kl"))
            if want["argmax"]:
                ram = part.indices("ref_argmax")
                blocks["ram"].append(ram + j)
                blocks["ramv"].append(_at(r, rows_n, ram))
            if t is not None:
                rt[inb] = _at(r, inb, t[inb] - j)
    lse, lw = _merge_lse(blocks["lse"])
    redo |= ~np.isfinite(lse)
    res: Dict[str, Any] = {}
    if t is not None and out.nll is not None:
        res["nll"] = lse - zt
    if want["entropy"]:  # H = sum_b w_b (H_b - ln w_b), w_b the block's share of the mass
        res["entropy"] = _weighted(lw, [e - v for e, v in zip(blocks["ent"], lw)])
    if want["argmax"]:
        res["argmax"] = _take_best(blocks["amv"], blocks["am"])
    if want["top_logprob"]:  # max_b (M_b - lse_b) + (lse_b - lse) = M - lse
        with np.errstate(invalid="ignore"):
            res["top_logprob"] = np.minimum(np.max(np.stack(blocks["top"]) + np.stack(lw), 0), 0.0)
    if want_rank:
        res["rank"] = above
    if ref:
        rlse, rlw = _merge_lse(blocks["rlse"])
        redo |= ~np.isfinite(rlse)
        if t is not None and out.ref_nll is not None:
            res["ref_nll"] = rlse - rt
        if want["kl"]:  # KL = sum_b W_b (KL_b + ln W_b - ln w_b), W_b the reference's share
            res["kl"] = _weighted(rlw, [k + rv - v for k, rv, v in zip(blocks["kl"], rlw, lw)])
        if want["argmax"]:
            res["ref_argmax"] = _take_best(blocks["ramv"], blocks["ram"])
    for name, values in res.items():
        arr = getattr(out, name)
        if arr is not None:
            arr[sel] = values if name in INDEX_OUTPUTS or name == "top_logprob" else np.where(values < 0, 0.0, values)
    if redo.any():
        _lazy_rows_alone(run, logits, reference, sel[redo], None if t is None else t[redo], out, lead, cap, threads,
                         want)


def _lazy_rows_alone(run: RunFn, logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                     lead: Tuple[int, ...], cap: float, threads: int, want: Dict[str, bool]) -> None:
    """Rows sel one at a time, each whole (a row's vocabulary at once)."""
    for i in range(sel.size):
        _lazy_rows(run, logits, reference, sel[i:i + 1], None if t is None else t[i:i + 1], out, lead, cap, threads,
                   want)


def _need_targets(t: Optional[I64Array]) -> I64Array:
    if t is None:
        raise RuntimeError("lmmetrics: internal error: the rank needs targets")
    return t


def _target_logits(logits: Any, sel: I64Array, t: I64Array, lead: Tuple[int, ...], block: int,
                   cap: float) -> F64Array:
    """The targets' logits of rows sel, as float64: for each vocabulary
    block, the tile of the rows whose target lies in it (one block a row)."""
    zt = np.zeros(sel.size)
    for j in range(0, t.size and int(t.max()) + 1, block):
        inb = np.flatnonzero((t >= j) & (t < j + block))
        if inb.size:
            z = _take_rows(logits, sel[inb], lead, slice(j, j + block), cap)
            zt[inb] = _at(z, np.arange(inb.size), t[inb] - j)
    return zt


def _count_above(z: Any, thr: F64Array) -> I64Array:
    """Per row of the tile z, its values above thr (compared as the tile
    holds them: exact against a float64 threshold)."""
    if is_torch(z):
        import torch

        above = (z > torch.from_numpy(thr).to(z.device)[:, None]).sum(1)
        counts: I64Array = above.cpu().numpy().astype(np.int64)
        return counts
    counts = np.count_nonzero(z > thr[:, None], axis=1).astype(np.int64)
    return counts


def _merge_lse(parts: List[F64Array]) -> Tuple[F64Array, List[F64Array]]:
    """The logsumexp over blocks of the blocks' logsumexps, and each block's
    ln share of the mass (lse_b - lse)."""
    stack = np.stack(parts)
    with np.errstate(all="ignore"):
        m = stack.max(0)
        lse = m + np.log(np.exp(stack - m).sum(0))
        return lse, list(stack - lse)


def _weighted(log_shares: List[F64Array], values: List[F64Array]) -> F64Array:
    """sum_b exp(log_share_b) value_b, a block without mass adding nothing."""
    total = np.zeros_like(log_shares[0])
    with np.errstate(all="ignore"):
        for lw, v in zip(log_shares, values):
            w = np.exp(lw)
            total += np.where(w > 0, w * v, 0.0)
    return total


def _take_best(values: List[F64Array], index: List[I64Array]) -> I64Array:
    """Per row the index of the largest value over blocks, the first block on
    ties (each block's argmax is its first maximum)."""
    k = np.argmax(np.stack(values), 0)
    picked: I64Array = np.stack(index)[k, np.arange(k.size)]
    return picked


def _at(x: Any, rows: I64Array, cols: I64Array) -> F64Array:
    """x[rows[i], cols[i]] as float64 numpy (the few values a tile's merge
    reads; for tensors one small copy to the host)."""
    if is_torch(x):
        import torch

        dev = x.device
        picked = x[torch.from_numpy(rows).to(dev), torch.from_numpy(np.ascontiguousarray(cols)).to(dev)]
        host: F64Array = picked.to("cpu", torch.float64).numpy()
        return host
    return np.asarray(x[rows, cols], np.float64)


def _cuda_chunk_bytes() -> int:
    from ._cuda import chunk_bytes

    return chunk_bytes()


def _take_rows(x: Any, rows: I64Array, lead_shape: Tuple[int, ...], cols: Optional[slice] = None,
               cap: float = 0.0) -> Any:
    """Rows ``rows`` (flat row numbers) of logits x as (len(rows), V), or
    their columns ``cols`` capped by ``cap``: lazy logits computed now, plain
    ones copied (those rows only)."""
    if isinstance(x, Projected):
        return x.rows(rows) if cols is None else x.rows(rows, cols, cap)
    if cols is not None:
        tile = _take_rows(x, rows, lead_shape)[:, cols]
        if not cap:
            return tile
        return np.tanh(tile / cap) * cap if isinstance(tile, np.ndarray) else (tile.float() / cap).tanh() * cap
    index = np.unravel_index(rows, lead_shape) if lead_shape else (np.zeros_like(rows),)
    if is_torch(x):
        x = x.detach()
        if not lead_shape:
            x = x[None]
        return x[tuple(to_device(k, x.device) for k in index)]
    return np.asarray(x)[index] if lead_shape else np.asarray(x)[None][index]
