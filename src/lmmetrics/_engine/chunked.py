"""Lazy logits through the engine a bounded chunk at a time.

`run_lazy` passes plain logits to the backends (`.backend`):
the counted rows (every row without targets) in chunks whose logits fit the
budget, each chunk computed (`lmmetrics._engine.lazy.Projected.rows`), read
and dropped. Where whole rows do not fit the budget 2048 at a time, a chunk
is cut into tiles of rows x a vocabulary block, and the blocks' results are
merged exactly in float64: each block's logsumexp is its largest logit
less its top log-probability (the reference's: its NLL at its own largest
logit, the tile's targets, plus that logit), held as that logit and the
rest and merged relative to the row's largest (`_merge_lse`), the entropy is the mixture's, the KL weights
each block's by the reference's share, the argmax is the first of the
largest, the top token's log-probability the largest of the blocks' (each
moved by its block's share of the mass), and the rank (the logits above
the target's, and those tied with it at a lower index) the sum of the
blocks' counts against the target's logit, which a first look at each
row's target block gives (that block's tile, all the chunk's rows: the
bits the pass computes there, for ties across blocks): a block before the target's counts its values >= it, a block after
it those above it, the target's own block splits at the target. A block
where a row is all -inf (a -inf bias masking padded vocabulary entries)
holds none of that row's mass and adds nothing to it. Rows the blocks
cannot certify (+inf logits, every block -inf: an error) are done again
whole, one at a time. Ignored rows are never projected.

On a CUDA device, chunks of whole rows go through the CUDA pass without
waiting for it (`lmmetrics._engine.cuda.launch`); their per-row results stay
on the device and come to the host in one transfer once every chunk is
launched (`_settle`). So do tiles: each goes through the CUDA pass
without waiting, the blocks' values (and the targets' logits, the rank's
counts) stay on the device and are merged there in float64 by the same
formulas as numpy's merge on the host (torch's ops, in the same order), into
the CUDA pass's result buffer of the chunk, which joins the others for that
one transfer. A row some block cannot certify is flagged there and done
again whole by the exact path after the transfer, which names a bad row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from . import inputs as _inputs
from . import cuda as _cuda
from .cuda import layout
from .cuda.torch_path import count_before
from .device import to_device
from .errors import RowError, Status, row_error
from .inputs import is_torch
from .lazy import DEFAULT_CHUNK_BYTES, Projected
from .backend import compute
from .request import INDEX_OUTPUTS, OUTPUTS, RowResults, Want, allocate, fsum, want_of
from .types import F64Array, I64Array

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
# On a GPU a matmul of a thousand rows already runs at the device's pace,
# and each vocabulary block costs launches: on an H100 (bfloat16, V 128256,
# 8192 tokens) whole rows of 1046 at a time took 1.05x the materialized
# logits + F.cross_entropy, two blocks of 2048 rows 1.20x.
_TILE_ROWS_CUDA = 1024
_MIN_BLOCK = 512


def run_lazy(logits: Any, targets: Any, reference: Any, ignore: int, cap: float, threads: int,
             want: Want) -> RowResults:
    """Lazy logits (either side or both) through the backends: the counted rows (all
    rows without targets) a bounded chunk at a time, each chunk's logits
    computed, passed to the backend as plain logits, and dropped."""
    # (the plain side as the backends take it: a list or a buffer as an array)
    logits, reference = (x if x is None or isinstance(x, (Projected, np.ndarray)) or is_torch(x) else np.asarray(x)
                         for x in (logits, reference))
    lg, ref = _lazy_shape(logits), None if reference is None else _lazy_shape(reference)
    if ref is not None and ref.n_cols != lg.n_cols:
        raise ValueError(f"the model's vocabulary ({lg.n_cols}) and the reference's ({ref.n_cols}) differ: "
                         f"a KL divergence needs one vocabulary")
    sides = [x for x in (logits, reference) if x is not None]
    if cap and any(isinstance(x, Projected) and x.softcap for x in sides):
        raise ValueError("softcap is given both to the metric and to projected(): give it once "
                         "(projected()'s applies to those logits only)")
    out = allocate(lg, ref, targets, ignore, check_range=True, want=want)
    for name in OUTPUTS:
        arr = getattr(out, name)
        if arr is not None:  # ignored rows: as the core leaves them
            arr.fill(-1 if name in INDEX_OUTPUTS else 0)
    rows = np.flatnonzero(out.counted) if out.targets is not None else np.arange(lg.n_rows)
    lazy = [x for x in sides if isinstance(x, Projected)]
    on_cuda = any(_inputs.is_cuda(x.hidden) for x in lazy)
    set_budgets = [x.chunk_bytes for x in lazy if x.chunk_bytes]  # (both sides': the smaller)
    budget = min(set_budgets) if set_budgets else layout.chunk_bytes() if on_cuda else DEFAULT_CHUNK_BYTES
    tile_rows = _TILE_ROWS_CUDA if on_cuda else _TILE_ROWS
    per_col = sum(x.itemsize if isinstance(x, Projected) else x.dtype.itemsize
                  if isinstance(x, np.ndarray) else x.element_size() for x in sides)
    V = lg.n_cols
    step = whole = max(1, budget // (V * per_col))
    block = V
    if step < min(rows.size, tile_rows) and V > _MIN_BLOCK:  # tiles of rows x a vocabulary block
        step = max(1, min(rows.size, tile_rows, budget // (_MIN_BLOCK * per_col)))
        block = max(_MIN_BLOCK, budget // (step * per_col))
    on_device: List[Tuple[I64Array, Any]] = []  # CUDA chunks: their rows and results, on the device
    for a in range(0, rows.size, step):
        sel = rows[a:a + step]
        t = None if out.targets is None else out.targets[sel]
        if block >= V:
            _lazy_rows(logits, reference, sel, t, out, lg.lead_shape, cap, threads, want, on_device)
        else:
            _lazy_tiles(logits, reference, sel, t, out, lg.lead_shape, block, cap, threads, want, on_device)
    if on_device:
        _settle(logits, reference, on_device, out, lg.lead_shape, cap, whole)
    out.n_counted = int(rows.size)
    out.nll_sum = fsum(out.nll) if out.nll is not None else 0.0
    return out


def _lazy_rows(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
               lead: Tuple[int, ...], cap: float, threads: int, want: Want,
               on_device: Optional[List[Tuple[I64Array, Any]]] = None) -> None:
    """Rows sel, whole, through the backend; their results into out. CUDA
    logits, given on_device, go through the CUDA pass without waiting for
    the device: sel and the pass's results (on the device) join on_device,
    for `_settle` once every chunk is launched."""
    z = _take_rows(logits, sel, lead)
    r = None if reference is None else _take_rows(reference, sel, lead)
    if on_device is not None and (_inputs.is_cuda(z) or _inputs.is_cuda(r)):
        on_device.append((sel, _launch(z, r, t, cap, want)))
        return
    _into(out, sel, lead, lambda: compute(z, t, r, -1, cap, threads, want))


def _launch(z: Any, r: Any, t: Optional[I64Array], cap: float, want: Want,
            on_device: Any = None) -> Any:
    """The CUDA pass over the logits z (and r) of some rows, targets t (or
    the targets on_device, a tensor there, every row counted), launched
    without waiting for the device: its result buffer
    (`lmmetrics._engine.cuda.layout.N_RESULTS` x rows, on the device)."""

    c_lg = _cuda.describe(z)
    c_ref = None if r is None else _cuda.describe(r, "reference_logits")
    part = allocate(c_lg, c_ref, t, -1, check_range=False, want=want)  # (its arrays stay unfilled)
    return _cuda.launch(c_lg, c_ref, part, cap, on_device)


def _row_argmax(x: Any) -> Any:
    """Per row of the tile x the column of its largest value (int64: numpy,
    or a tensor on x's device, read by no one)."""
    if isinstance(x, np.ndarray):
        return np.argmax(x, axis=1).astype(np.int64)
    return x.argmax(1)


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
    """The CUDA chunks' results to the host in one transfer, into out; the
    rows the pass could not certify done again by the exact path, step rows
    at a time, as the CUDA pass of each chunk would have done them, those up
    to the first bad row before it raises (`lmmetrics._engine.cuda.settle`:
    the first bad row is named, as the core names it). Their logits are
    computed again (the chunks' are gone), from a product of fewer rows: on
    a GPU the matmul may round them a last bit differently, as a change of
    chunk_bytes would."""
    import torch

    rows = np.concatenate([sel for sel, _ in on_device])
    res = torch.cat([part for _, part in on_device], 1)
    on_device.clear()

    def exact(sel: I64Array) -> RowResults:
        n = sel.size
        lg = _cuda.describe(_take_rows(logits, sel, lead))
        ref = None if reference is None else _cuda.describe(_take_rows(reference, sel, lead), "reference_logits")
        t = None if out.targets is None else out.targets[sel]
        part = out.derived((n,), t, lambda v: np.empty(n, v.dtype))
        _cuda.exact_rows(np.arange(n), lg, ref, part, cap, None if t is None else to_device(t, lg.keep.device))
        return part

    def redo(at: I64Array) -> None:  # (before a later row's error is raised: the first bad row is named)
        slow = rows[at]
        for a in range(0, slow.size, step):
            sel = slow[a:a + step]
            _into(out, sel, lead, lambda: exact(sel))

    _cuda.settle(res, out, rows, lead, redo=redo)


def _lazy_tiles(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                lead: Tuple[int, ...], block: int, cap: float, threads: int, want: Want,
                on_device: Optional[List[Tuple[I64Array, Any]]] = None) -> None:
    """Rows sel a vocabulary block at a time: each tile through the backend,
    which gives the block's logsumexp (its largest logit less its top
    log-probability; the reference's, its NLL at its largest logit, the
    tile's targets, plus that logit); the blocks merged in float64. A row
    the blocks cannot certify (+inf logits; every block all -inf: an error)
    is done again whole, alone; a block all -inf in a row holds none of its
    mass (`_run_tile`).

    CUDA logits, given on_device, go through the CUDA pass a tile at a time
    without waiting for the device (`_launch`): the blocks' values
    stay there and are merged there, in float64 by the same formulas (torch
    for numpy), into one result buffer (`lmmetrics._engine.cuda.layout.N_RESULTS`
    x rows) that joins on_device for `_settle`; a row some block
    cannot certify (flagged, a value not finite where its side has mass in
    the block, or its logsumexp not finite: `_tile_redo`) is flagged F_REDO there, and done again whole by the exact path after the one
    transfer (which names a bad row)."""
    V = out.n_cols
    n = sel.size
    ref = reference is not None
    # each block's logsumexp from its own largest logit: M_b - (its top
    # log-probability); the reference's from its NLL at the reference's
    # largest logit (the tile's targets), plus that logit. (From a fixed
    # column, a logit far below the block's max, a -1e9 mask, would cancel
    # the NLL's digits away.) No NLL at the tile's targets: unread, and
    # on the device inf where a block's first column is -inf (a masked
    # token 0), which sent every row to the exact path.
    kw = want_of({"entropy": "entropy" in want, "argmax": True, "kl": "kl" in want, "ref_nll": ref,
                  "top_logprob": True})
    dev = None if on_device is None else _cuda_device(logits, reference)
    xp: Any = np
    if dev is not None:
        import torch

        xp = torch
    blocks: Dict[str, List[Any]] = {k: [] for k in ("rel", "ent", "amv", "am", "rmax", "rrel", "kl", "ramv", "ram")}
    want_rank = "rank" in want and t is not None
    above = _zeros(n, np.int64, dev)
    thr = _target_logits(logits, sel, _need_targets(t), lead, block, V, cap, dev) if want_rank else _zeros(n, dev=dev)
    zt = _zeros(n, dev=dev)
    rt = _zeros(n, dev=dev)
    redo = _zeros(n, bool, dev)
    col0 = np.zeros(n, np.int64)
    rows_n = np.arange(n) if dev is None else xp.arange(n, device=dev)
    massless = [np.ones(n, bool), np.ones(n, bool)]  # (host) rows without mass so far: logits, reference
    for j in range(0, V, block):
        cols = slice(j, min(V, j + block))
        z = _take_rows(logits, sel, lead, cols, cap)
        r = None if not ref else _take_rows(reference, sel, lead, cols, cap)
        anchor = col0 if r is None else _row_argmax(r)
        if dev is not None:  # the tile's values and flags stay on the device
            res = _launch(z, r, col0, 0.0, kw, anchor if r is not None else None)
            floats: Callable[[Any], Any] = lambda name: res[layout.row(name)]  # noqa: E731
            # (a flagged row's index, a NaN row's, may lie past the tile: the
            # Triton kernel gives 1 in a tile one column wide; read in the
            # tile, it is done again whole)
            indices: Callable[[Any], Any] = lambda name: res[layout.row(name)].long().clamp_(  # noqa: E731
                0, cols.stop - cols.start - 1)
        else:
            try:
                part = _run_tile(z, r, anchor, threads, kw)
            except RowError as e:
                # a NaN: the first bad row is named, though an earlier row's
                # NaN may sit in a later block, or its blocks all be -inf
                row, status = _first_bad(logits, reference, sel, lead, j, block, cap, e.row, e.status, massless)
                raise row_error(status, int(sel[row]), lead) from None
            floats, indices = part.floats, part.indices
        # a row all -inf in this block (a -inf bias masking padded entries)
        # holds none of its mass here: its block values are not read
        am = indices("argmax")
        amv = _at(z, rows_n, am, dev)
        none = amv == -math.inf
        rmax = None if r is None else _at(r, rows_n, anchor, dev)  # (anchor: the reference's argmax)
        rnone = xp.zeros_like(none) if rmax is None else rmax == -math.inf
        if dev is not None:
            redo |= _tile_redo(res, kw, none, rnone)
        else:
            massless[0] &= none
            massless[1] &= rnone
        blocks["amv"].append(amv)  # the block's largest value, -inf without mass
        blocks["rel"].append(xp.where(none, 0.0, -floats("top_logprob")))  # its logsumexp less amv
        if "entropy" in want:
            blocks["ent"].append(xp.where(none, 0.0, floats("entropy")))
        if "argmax" in want:
            blocks["am"].append(am + j)
        if t is not None:
            inb = np.flatnonzero((t >= cols.start) & (t < cols.stop))
            _set(zt, inb, _at(z, inb, t[inb] - j, dev))
        if want_rank:  # the target's own block: its own value
            _set(thr, inb, zt[_index(inb, dev)])
            above += _count_before(z, thr, _need_targets(t) - j)
        if ref:
            blocks["rmax"].append(xp.where(rnone, -math.inf, rmax))
            blocks["rrel"].append(xp.where(rnone, 0.0, floats("ref_nll")))
            if "kl" in want:  # (the model's block without mass, the reference's with: inf, by its share)
                blocks["kl"].append(xp.where(none | rnone, 0.0, floats("kl")))
            if "argmax" in want:
                ram = indices("ref_argmax")
                blocks["ram"].append(ram + j)
                blocks["ramv"].append(_at(r, rows_n, ram, dev))
            if t is not None:
                _set(rt, inb, _at(r, inb, t[inb] - j, dev))
        z = r = None  # (freed before the next tile is computed: one tile's memory at a time)
    top, rel, lw = _merge_lse(blocks["amv"], blocks["rel"], xp)
    merged: Dict[str, Any] = {}
    with np.errstate(invalid="ignore"):  # (inf - inf, a +inf logit: the row is done again whole)
        redo |= ~xp.isfinite(top + rel)
        if t is not None and out.nll is not None:
            merged["nll"] = (top - zt) + rel
    if "entropy" in want:  # H = sum_b w_b (H_b - ln w_b), w_b the block's share of the mass
        merged["entropy"] = _weighted(lw, [e - v for e, v in zip(blocks["ent"], lw)], xp)
    if "argmax" in want:
        merged["argmax"] = _take_best(blocks["amv"], blocks["am"], xp)
    if "top_logprob" in want:  # M - lse
        merged["top_logprob"] = xp.clip(-rel, None, 0.0)
    if want_rank:
        merged["rank"] = above
    if ref:
        rtop, rrel, rlw = _merge_lse(blocks["rmax"], blocks["rrel"], xp)
        with np.errstate(invalid="ignore"):
            redo |= ~xp.isfinite(rtop + rrel)
            if t is not None and out.ref_nll is not None:
                merged["ref_nll"] = (rtop - rt) + rrel
        if "kl" in want:  # KL = sum_b W_b (KL_b + ln W_b - ln w_b), W_b the reference's share
            with np.errstate(invalid="ignore"):  # (-inf - -inf: a block without mass on both sides, weight 0)
                merged["kl"] = _weighted(rlw, [k + rv - v for k, rv, v in zip(blocks["kl"], rlw, lw)], xp)
        if "argmax" in want:
            merged["ref_argmax"] = _take_best(blocks["ramv"], blocks["ram"], xp)
    values = {name: v if name in INDEX_OUTPUTS or name == "top_logprob" else xp.where(v < 0, 0.0, v)
              for name, v in merged.items() if getattr(out, name) is not None}
    if dev is not None and on_device is not None:
        on_device.append((sel, _as_results(values, redo, n, dev)))
        return
    for name, v in values.items():
        getattr(out, name)[sel] = v
    if redo.any():
        _lazy_rows_alone(logits, reference, sel[redo], None if t is None else t[redo], out, lead, cap, threads,
                         want)


def _run_tile(z: Any, r: Any, anchor: Any, threads: int, kw: Want) -> RowResults:
    """The backend over a tile (some rows' vocabulary block, and the
    reference's), targets anchor. A row all -inf in the block, on either
    side, which the core refuses, holds none of the row's mass there: it is
    run as zeros (the merge does not read its values) and the tile
    restored (its own copy: computed, or copied from the logits)."""
    try:
        return compute(z, anchor, r, -1, 0.0, threads, kw)
    except RowError as e:
        if e.status not in (Status.LM_ERR_EMPTY, Status.LM_ERR_EMPTY_REF):
            raise
    empty = [None if x is None else _massless(x) for x in (z, r)]
    for x, rows in zip((z, r), empty):
        if x is not None:
            x[rows] = 0
    try:
        return compute(z, anchor, r, -1, 0.0, threads, kw)
    finally:
        for x, rows in zip((z, r), empty):
            if x is not None:
                x[rows] = -math.inf


def _massless(x: Any) -> Any:
    """Per row of the tile x (numpy or a tensor), whether it is all -inf (a
    NaN is not)."""
    return x.max(1) == -math.inf if isinstance(x, np.ndarray) else x.amax(1) == -math.inf


def _tile_redo(res: Any, kw: Want, none: Any, rnone: Any) -> Any:
    """The rows of a CUDA tile's pass (its result buffer res) that the merge
    cannot certify: flagged (NaN, +inf, a KL term beyond float), or a value
    not finite on a side with mass in the block; a side all -inf there (none,
    rnone: flagged as empty, its values NaN) holds none of the row's mass.
    A torch chunk's F_REDO flags all its rows: the rows are certified one by
    one, by their values, as it does."""
    import torch

    flags = res[layout.RES_FLAGS].long()
    bad = (flags & ((layout.ERRORS | layout.SLOW) & ~(layout.F_REDO | layout.F_EMPTY | layout.F_EMPTY_REF))) != 0
    for name in OUTPUTS:
        if name in kw and name not in INDEX_OUTPUTS:
            skip = none | rnone if name == "kl" else rnone if name == "ref_nll" else none
            bad |= ~torch.isfinite(res[layout.row(name)]) & ~skip
    return bad


# a row's errors in the order the core checks them
_ORDER = (Status.LM_ERR_NAN, Status.LM_ERR_EMPTY, Status.LM_ERR_NAN_REF, Status.LM_ERR_EMPTY_REF)


def _first_bad(logits: Any, reference: Any, sel: I64Array, lead: Tuple[int, ...], start: int, block: int,
               cap: float, row: int, status: Status, massless: List[Any]) -> Tuple[int, Status]:
    """The first of the rows sel that is bad (NaN, or all -inf, on either
    side), and its error, as the core names it on whole rows, given that row
    (a position in sel) is the first with a NaN in the blocks up to start's
    (status), and massless the rows (logits', reference's) all -inf in the
    blocks before start: the blocks from start on, for the rows up to row."""
    V = _lazy_shape(logits).n_cols
    found = [(row, _ORDER.index(status))]
    for side, k in ((logits, 0), (reference, 2)):
        if side is None:
            continue
        nan = np.zeros(row + 1, bool)
        empty = np.array(massless[k // 2][:row + 1])
        for j in range(start, V, block):
            x = _take_rows(side, sel[:row + 1], lead, slice(j, min(V, j + block)), cap)
            nan |= np.asarray((x != x).any(1))
            empty &= np.asarray((x == -math.inf).all(1))
        found += [(int(i), k) for i in np.flatnonzero(nan)[:1]] + [(int(i), k + 1) for i in np.flatnonzero(empty)[:1]]
    first, which = min(found)
    return first, _ORDER[which]


def _as_results(values: Dict[str, Any], redo: Any, n: int, dev: Any) -> Any:
    """A CUDA tile chunk's merged outputs as the CUDA pass's result buffer
    (on the device): the rows to do again flagged F_REDO."""
    import torch

    res = torch.zeros((layout.N_RESULTS, n), dtype=torch.float64, device=dev)
    res[layout.RES_FLAGS] = torch.where(redo, float(layout.F_REDO), 0.0)
    for name, v in values.items():
        res[layout.row(name)] = v
    return res


def _cuda_device(*sides: Any) -> Any:
    """The device of the first of sides (logits, lazy logits' hidden states)
    that is on a CUDA device, else None."""
    for x in sides:
        keep = x.hidden if isinstance(x, Projected) else x
        if x is not None and _inputs.is_cuda(keep):
            return keep.device
    return None


def _zeros(n: int, dtype: Any = np.float64, dev: Any = None) -> Any:
    """n zeros of the numpy dtype: numpy, or a tensor on the device dev."""
    if dev is None:
        return np.zeros(n, dtype)
    import torch

    return torch.zeros(n, dtype={np.float64: torch.float64, np.int64: torch.int64, bool: torch.bool}[dtype],
                       device=dev)


def _index(idx: I64Array, dev: Any) -> Any:
    """A numpy index as the arrays on dev index: itself, or on the device."""
    return idx if dev is None else to_device(idx, dev)


def _set(arr: Any, idx: I64Array, values: Any) -> None:
    """arr[idx] = values, arr numpy or a tensor (idx numpy)."""
    arr[_index(idx, None if isinstance(arr, np.ndarray) else arr.device)] = values


def _lazy_rows_alone(logits: Any, reference: Any, sel: I64Array, t: Optional[I64Array], out: RowResults,
                     lead: Tuple[int, ...], cap: float, threads: int, want: Want) -> None:
    """Rows sel one at a time, each whole (a row's vocabulary at once)."""
    for i in range(sel.size):
        _lazy_rows(logits, reference, sel[i:i + 1], None if t is None else t[i:i + 1], out, lead, cap, threads,
                   want)


def _need_targets(t: Optional[I64Array]) -> I64Array:
    if t is None:
        raise RuntimeError("lmmetrics: internal error: the rank needs targets")
    return t


def _target_logits(logits: Any, sel: I64Array, t: I64Array, lead: Tuple[int, ...], block: int, n_cols: int,
                   cap: float, dev: Any = None) -> Any:
    """The targets' logits of rows sel, as float64 (numpy, or with dev a
    tensor on that device): for each vocabulary block holding a target, the
    tile of all the rows, as `_lazy_tiles` computes it (the same rows and
    columns: the same bits, where a matmul over the rows whose target lies
    there rounds otherwise, and a target tied with an earlier block's logit
    in the materialized logits, a duplicate head row, ranked one off)."""
    zt = _zeros(sel.size, dev=dev)
    for j in range(0, t.size and int(t.max()) + 1, block):
        inb = np.flatnonzero((t >= j) & (t < j + block))
        if inb.size:
            z = _take_rows(logits, sel, lead, slice(j, min(n_cols, j + block)), cap)
            _set(zt, inb, _at(z, inb, t[inb] - j, dev))
    return zt


def _count_before(z: Any, thr: Any, at: I64Array) -> Any:
    """Per row of the tile z, its values that rank before the target's, thr,
    at column at of the tile (below 0 or past the tile where the target lies
    in another block): those above thr, and those equal to it at a column
    below at (the rank's rule, the first argmax's order, on the whole row's
    indices). Compared as the tile holds them: exact against a float64
    threshold. A threshold on the device (a CUDA tile's) gives the counts
    there; else int64 numpy."""
    if is_torch(z):
        import torch

        on_device = isinstance(thr, torch.Tensor)
        th = (thr if on_device else torch.from_numpy(thr).to(z.device))[:, None]
        hits = count_before(z, th, to_device(at, z.device)[:, None])
        if on_device:
            return hits
        counts: I64Array = hits.cpu().numpy().astype(np.int64)
        return counts
    th = thr[:, None]
    before = np.arange(z.shape[1])[None, :] < at[:, None]
    counts = np.count_nonzero((z > th) | ((z == th) & before), axis=1).astype(np.int64)
    return counts


# The merge of the blocks' values: numpy on the host, torch (xp) for a CUDA
# tile's values on its device; the same float64 operations in the same order
# (a sum over blocks one block after the other, as numpy's sum over axis 0).

def _merge_lse(maxes: List[Any], rels: List[Any], xp: Any = np) -> Tuple[Any, Any, List[Any]]:
    """The logsumexp over blocks of the blocks' logsumexps, each given as its
    largest value M_b (-inf: no mass) and the rest, s_b = lse_b - M_b: the
    largest value M, the rest s of the whole (lse = M + s), and each
    block's ln share of the mass, lse_b - lse = (M_b - M) + (s_b - s). Never
    summed: past 2**53 times s_b, M_b + s_b is M_b, and a row of logits of
    1e17 lost its ties (the NLL of a target among three tied maxima in two
    blocks was 0, not ln 3)."""
    with np.errstate(all="ignore"):
        m = xp.amax(xp.stack(maxes), 0)
        offsets = [(mb - m) + sb for mb, sb in zip(maxes, rels)]
        total = xp.exp(offsets[0])
        for o in offsets[1:]:
            total = total + xp.exp(o)
        rest = xp.log(total)
        return m, rest, [o - rest for o in offsets]


def _weighted(log_shares: List[Any], values: List[Any], xp: Any = np) -> Any:
    """sum_b exp(log_share_b) value_b, a block without mass adding nothing."""
    total = xp.zeros_like(log_shares[0])
    with np.errstate(all="ignore"):
        for lw, v in zip(log_shares, values):
            w = xp.exp(lw)
            total += xp.where(w > 0, w * v, 0.0)
    return total


def _take_best(values: List[Any], index: List[Any], xp: Any = np) -> Any:
    """Per row the index of the largest value over blocks, the first block on
    ties (each block's argmax is its first maximum)."""
    k = xp.argmax(xp.stack(values), 0)
    stack = xp.stack(index)
    if xp is not np:
        return stack.gather(0, k[None])[0]
    picked: I64Array = stack[k, np.arange(k.size)]
    return picked


def _at(x: Any, rows: Any, cols: Any, dev: Any = None) -> Any:
    """x[rows[i], cols[i]] as float64 numpy (the few values a tile's merge
    reads; for tensors one small copy to the host), or with dev (a CUDA
    tile's device) a float64 tensor there, read by no one (rows and cols
    numpy, or tensors on that device)."""
    if is_torch(x):
        import torch

        if dev is not None:
            at = [i if isinstance(i, torch.Tensor) else to_device(i, dev) for i in (rows, cols)]
            return x[at[0], at[1]].to(torch.float64)
        dev = x.device
        picked = x[torch.from_numpy(rows).to(dev), torch.from_numpy(np.ascontiguousarray(cols)).to(dev)]
        host: F64Array = picked.to("cpu", torch.float64).numpy()
        return host
    return np.asarray(x[rows, cols], np.float64)


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
        if isinstance(tile, np.ndarray):  # in float32 (float64 for float64), as the metric caps whole rows
            return np.tanh(tile.astype(np.float64 if tile.dtype == np.float64 else np.float32) / cap) * cap
        import torch

        return (tile.to(torch.float64 if tile.dtype == torch.float64 else torch.float32) / cap).tanh() * cap
    index = np.unravel_index(rows, lead_shape) if lead_shape else (np.zeros_like(rows),)
    if is_torch(x):
        x = x.detach()
        if not lead_shape:
            x = x[None]
        return x[tuple(to_device(k, x.device) for k in index)]
    return np.asarray(x)[index] if lead_shape else np.asarray(x)[None][index]
