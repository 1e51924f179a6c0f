"""CUDA tensors through Triton: every per-row value in one read of the logits.

The vocabulary axis is cut into tiles of ``TILE`` elements. The first
kernel (``_tiles``) reduces each (row, tile) to a small state, in float32:
the tile's max m, the sums s = sum e, e = exp(z - m), and t = sum e (z - m)
(entropy), the first index of the max, flags (NaN, +inf); with a reference
buffer, read in the same pass, its max, sum, first argmax and the KL cross
term c = sum e_r ((r - rm) - (z - m)). A softcap c tanh(z / c) is applied on
the fly. The second kernel (``_merge``) combines a row's tile states in
float64, in a fixed order, and writes the per-row values. A program of the
first kernel takes a run of consecutive tiles of one row, so few long rows
still spread over many programs; the states, and so the results, depend
only on the tile size, never on how many tiles a program takes, how many
rows a launch holds, or how many multiprocessors the device has. Extra memory: 36 bytes a tile of the
rows in flight (bounded) and 64 bytes a row with the targets; no N x V
temporary.

Ignored rows (target negative or ``ignore_index``) are not read. Rows that
hold +inf, or whose KL cross term is beyond float range (the model masks
where the reference does not), are done again by the exact torch path of
`lmmetrics._engine.cuda`; NaN and all -inf rows among the counted ones raise
the native core's errors, naming the first bad row. The per-row values go
into the pass's buffer on the device (`lmmetrics._engine.cuda.layout.N_RESULTS`
values a row), which `lmmetrics._engine.cuda` brings to the host once when the
pass ends: no launch waits for the device. float64 logits keep the
torch path, and so does a request for the rank (the logits above the
target's and those tied with it before it: `usable` says no; the top token's log-probability, -log S
against the row's max, comes from the merge).
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import numpy as np

import triton
import triton.language as tl

from .layout import (F_COUNTED, F_EMPTY, F_EMPTY_REF, F_INF, F_INF_REF, F_OOB, N_RESULTS, RES_FLAGS, RES_TARGETS,
                     TILE_FLAGS, CudaLogits, chunk_bytes, row)
from ..inputs import collapse
from ..request import RowResults

if TYPE_CHECKING:
    import torch


# Elements of a row a tile holds: the results depend on it (and only on it).
TILE = 2048
# 4 warps (16 elements a thread): on an H100 (triton 3.6) NLL over 8192 x
# 128256 ran 0.45 of a read-only pass in bfloat16 and 0.70 in float32,
# against 0.35 / 0.67 at 8 warps, 0.22 / 0.44 at 16 and 0.37 / 0.55 at
# tile 1024 with 4 (the per-tile reductions, not the loads, set the pace)
NUM_WARPS = 4
# The merge kernel loads all tiles of ROWS rows at once: ROWS x NT
# (NT = n_tiles to a power of 2) at most this many; rows whose vocabulary
# needs more tiles than that (V > 8M at the default tile) keep the torch path.
_MERGE_ELEMS = 1024
_MAX_TILES = 4096
# Bound on the tile states of the rows in flight, and half the CUDA chunk
# setting at most (rows are launched in groups that fit; the outputs still
# come back in one transfer).
_STATE_BYTES = 64 * 2**20
_NFIELDS = 9  # m, s, t, am, flags, rm, rs, c, ram
# flag bits (per tile, then per row): layout.TILE_FLAGS, bit b a tile's
# 12-bit count field b, then F_EMPTY, F_EMPTY_REF per row
_F_INF, _F_INF_REF, _F_EMPTY, _F_EMPTY_REF, _F_COUNTED, _F_OOB = (
    tl.constexpr(f) for f in (F_INF, F_INF_REF, F_EMPTY, F_EMPTY_REF, F_COUNTED, F_OOB))
_N_TILE_FLAGS = tl.constexpr(len(TILE_FLAGS))
# KL cross-term lanes beyond this take the exact path (as LM_CROSS_BIG)
_CROSS_BIG = 1e20
# output rows of the (N_RESULTS, N) float64 result (layout.row; the rank's
# row is never written: requests with it keep the torch path)
_O_FLAGS, _O_TARGETS = tl.constexpr(RES_FLAGS), tl.constexpr(RES_TARGETS)
_O_NLL, _O_ENT, _O_AMAX, _O_KL, _O_RAMAX, _O_RNLL, _O_TOP = (
    tl.constexpr(row(name)) for name in ("nll", "entropy", "argmax", "kl", "ref_argmax", "ref_nll", "top_logprob"))
_N_RESULTS = N_RESULTS

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The jitted functions are annotated with triton.language names only:
# tl.tensor (a value, a pointer or a scalar argument inside the kernel),
# tl.constexpr (a compile-time constant), tl.tuple (several values). Never
# int / float / bool: triton reads those as the argument's type (i32, fp32,
# u1) and stops specialising on it; nor typing's names: triton's dependency
# scan of a kernel (its cache key) refuses them.


@triton.jit
def _tanh(u: tl.tensor) -> tl.tensor:
    """tanh from tl operations (libdevice is not in the interpreter): an odd
    polynomial (Taylor to u^11, error < 1e-9) below |u| = 0.3, else
    1 - 2 / (e^(2|u|) + 1); +-inf give +-1, NaN stays NaN."""
    a = tl.abs(u)
    a2 = a * a
    p = a2 * -0.008863235529902197 + 0.021869488536155203  # -1382/155925, 62/2835
    p = p * a2 - 0.05396825396825397  # 17/315
    p = p * a2 + 0.13333333333333333  # 2/15
    p = p * a2 - 0.3333333333333333
    small = a + a * a2 * p
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    v = tl.where(a < 0.3, small, big)
    return tl.where(u < 0, -v, v)


@triton.jit
def _at(base: tl.tensor, g: tl.tensor, inner: tl.tensor, stride: tl.tensor, outer: tl.tensor) -> tl.tensor:
    """The address of flat row g (int64) of a buffer whose row g lies at
    (g // inner) * outer + (g % inner) * stride (`layout.CudaLogits.rows`:
    a [..., :-1, :] view is one launch, not one a leading index)."""
    return base + (g // inner) * outer + (g % inner) * stride


@triton.jit
def _live(t: tl.tensor, ignore: tl.tensor, n_cols: tl.tensor) -> tl.tensor:
    """Whether a row with target t is counted and its target can be read."""
    return (t >= 0) & (t != ignore) & (t < n_cols)


@triton.jit
def _any_bits(fl: tl.tensor, axis: tl.constexpr, NBITS: tl.constexpr) -> tl.tensor:
    """The OR of the flags along axis (a max a bit: the interpreter runs a
    custom combine function element by element)."""
    acc = tl.max(fl & 1, axis)
    for b in tl.static_range(1, NBITS):
        acc = acc | (tl.max((fl >> b) & 1, axis) << b)
    return acc


@triton.jit
def _side(x: tl.tensor, mask: tl.tensor, offs: tl.tensor, cap: tl.tensor, inv_cap: tl.tensor, inv_lo: tl.tensor,
          CAPPED: tl.constexpr, WANT_T: tl.constexpr, WANT_AM: tl.constexpr) -> tl.tuple:
    """One side of a tile: values with NaN as -inf, max, shift, e, s, t,
    first argmax, and the lanes holding NaN and +inf (t and the argmax are 0
    when not wanted)."""
    x = x.to(tl.float32)
    if CAPPED:
        # x / c as x (hi + lo), hi + lo = 1 / c to twice float precision: x
        # times a rounded 1 / c would bias every capped logit one way (where
        # tanh is +-1 anyway, +-inf and huge x, the plain product)
        u = x * inv_cap
        u = tl.where(tl.abs(u) < 1e30, tl.fma(x, inv_cap, x * inv_lo), u)
        x = tl.where(mask, cap * _tanh(u), float("-inf"))
    nan = x != x
    xx = tl.where(nan, float("-inf"), x)
    m = tl.max(xx, 0)
    ms = tl.where(m == float("-inf"), 0.0, m)
    # unclamped: a clamp below the max (ms - 128) rounds back to ms when
    # |ms| passes ~3e9 and would count every lane as the max; masked and
    # padding lanes give d = -inf, e = 0, and add nothing to t
    d = xx - ms
    e = tl.exp(d)
    s = tl.sum(e, 0)
    t = 0.0
    if WANT_T:
        t = tl.sum(tl.where(e > 0, e * d, 0.0), 0)
    am = 0
    if WANT_AM:
        am = tl.min(tl.where(xx == m, offs, 2147483647), 0)
    return xx, m, ms, e, s, t, am, nan, xx == float("inf")


@triton.jit
def _tiles(z_ptr: tl.tensor, r_ptr: tl.tensor, tgt_ptr: tl.tensor, st_ptr: tl.tensor, row0: tl.tensor,
           n_rows: tl.tensor, n_cols: tl.tensor, z_inner: tl.tensor, z_stride: tl.tensor, z_outer: tl.tensor,
           r_inner: tl.tensor, r_stride: tl.tensor, r_outer: tl.tensor, t_inner: tl.tensor, t_stride: tl.tensor,
           t_outer: tl.tensor, ignore: tl.tensor, n_tiles: tl.tensor, per_prog: tl.tensor, cap: tl.tensor,
           inv_cap: tl.tensor, inv_lo: tl.tensor, TILE: tl.constexpr, HAS_TGT: tl.constexpr,
           HAS_REF: tl.constexpr, WANT_ENT: tl.constexpr, WANT_AMAX: tl.constexpr, CAPPED: tl.constexpr) -> None:
    """The states of tiles [first, first + per_prog) of row row0 + row (see
    the module's docstring); program (row, j) starts at tile j * per_prog."""
    row = tl.program_id(0).to(tl.int64)
    g = row0 + row
    first = tl.program_id(1) * per_prog
    offs = tl.arange(0, TILE)
    plane = n_tiles * n_rows  # fields of the states (bounded: int32)
    n_run = per_prog
    if HAS_TGT:  # a row not counted (or with a target out of range) is not read, nor are its states
        target = tl.load(_at(tgt_ptr, g, t_inner, t_stride, t_outer)).to(tl.int64)
        n_run = tl.where(_live(target, ignore, n_cols), per_prog, 0)
    zrow = _at(z_ptr, g, z_inner, z_stride, z_outer)
    rrow = _at(r_ptr, g, r_inner, r_stride, r_outer)
    for k in range(0, n_run):
        tile = first + k
        if tile < n_tiles:
            cols = tile * TILE + offs
            mask = cols < n_cols  # (n_cols, not a value chosen at run time: vector loads)
            z = tl.load(zrow + cols, mask=mask, other=float("-inf"))
            zz, m, ms, e, s, t, am, nan, inf = _side(z, mask, offs, cap, inv_cap, inv_lo, CAPPED, WANT_ENT, WANT_AMAX)
            # the flags' lane counts, 12 bits each (TILE < 4096), in one sum
            code = nan.to(tl.int64) + (inf.to(tl.int64) << 12)
            at = st_ptr + tile.to(tl.int64) * n_rows + row
            tl.store(at, m)
            tl.store(at + plane, s)
            tl.store(at + 2 * plane, t)
            tl.store(at + 3 * plane, am.to(tl.float32))
            if HAS_REF:
                r = tl.load(rrow + cols, mask=mask, other=float("-inf"))
                rr, rm, rms, er, rs, rt, ram, rnan, rinf = _side(r, mask, offs, cap, inv_cap, inv_lo, CAPPED, False,
                                                                 WANT_AMAX)
                # c = sum e_r d, d = (r - rm) - (z - m) unclamped; lanes with
                # e_r = 0 add nothing, and a d beyond float sums (the model
                # masks where the reference does not) sends the row to the
                # exact path
                d = (rr - rms) - (zz - ms)
                c = tl.sum(tl.where(er > 0, er * d, 0.0), 0)
                big = (rr > float("-inf")) & (d > 1e20)
                code += (rnan.to(tl.int64) << 24) + (rinf.to(tl.int64) << 36) + (big.to(tl.int64) << 48)
                tl.store(at + 5 * plane, rm)
                tl.store(at + 6 * plane, rs)
                tl.store(at + 7 * plane, c)
                tl.store(at + 8 * plane, ram.to(tl.float32))
            n = tl.sum(code, 0)
            flags = ((n & 4095) > 0).to(tl.int32)
            for b in tl.static_range(1, _N_TILE_FLAGS):
                flags = flags | ((((n >> (12 * b)) & 4095) > 0).to(tl.int32) << b)
            tl.store(at + 4 * plane, flags.to(tl.float32))


@triton.jit
def _capped64(v: tl.tensor, cap: tl.tensor, CAPPED: tl.constexpr) -> tl.tensor:
    """A target's logit, capped in float64 (divided by the cap, which is
    exact in float32 for the usual caps, rather than times 1 / c)."""
    v = v.to(tl.float64)
    if CAPPED:
        v = cap * _tanh(v / cap)
    return v


@triton.jit
def _nonneg(v: tl.tensor) -> tl.tensor:
    """v, 0 where rounding made it negative; a NaN stays NaN (the host
    sends such a row to the exact path: tl.maximum would turn it into 0)."""
    return tl.where(v < 0, 0.0, v)


@triton.jit
def _merge(st_ptr: tl.tensor, z_ptr: tl.tensor, r_ptr: tl.tensor, tgt_ptr: tl.tensor, out_ptr: tl.tensor,
           n_rows: tl.tensor, row0: tl.tensor, n_total: tl.tensor, n_cols: tl.tensor, n_tiles: tl.tensor,
           z_inner: tl.tensor, z_stride: tl.tensor, z_outer: tl.tensor, r_inner: tl.tensor, r_stride: tl.tensor,
           r_outer: tl.tensor, t_inner: tl.tensor, t_stride: tl.tensor, t_outer: tl.tensor, ignore: tl.tensor,
           cap: tl.tensor, inv_cap: tl.tensor, TILE: tl.constexpr, ROWS: tl.constexpr, NT: tl.constexpr,
           HAS_TGT: tl.constexpr, HAS_REF: tl.constexpr, WANT_ENT: tl.constexpr, CAPPED: tl.constexpr) -> None:
    """Per-row values from the tile states of ROWS rows, combined in float64
    by a fixed reduction over the tiles (NT: n_tiles to a power of 2); with
    targets, each row's flags F_COUNTED / F_OOB and its target."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    g = row0 + rows64
    plane = n_tiles * n_rows
    tgt = tl.zeros([ROWS], tl.int64)
    counted = rmask
    oob = rows < 0
    base = out_ptr + g
    if HAS_TGT:
        tgt = tl.load(_at(tgt_ptr, g, t_inner, t_stride, t_outer), mask=rmask, other=-1).to(tl.int64)
        tl.store(base + _O_TARGETS * n_total, tgt.to(tl.float64), mask=rmask)
        oob = rmask & (tgt >= 0) & (tgt != ignore) & (tgt >= n_cols)
        counted = rmask & _live(tgt, ignore, n_cols)
    tgt = tl.where(counted, tgt, 0)
    ninf = float("-inf")
    # all of a row's tiles at once (no loop: triton 3.7's thread-locality
    # pass fails on reductions accumulated across loop iterations)
    tj = tl.arange(0, NT)
    msk = counted[:, None] & (tj < n_tiles)[None, :]
    off = tj[None, :].to(tl.int64) * n_rows + rows64[:, None]
    m = tl.load(st_ptr + off, mask=msk, other=ninf)
    M = tl.max(m, 1)
    flags = _any_bits(tl.load(st_ptr + 4 * plane + off, mask=msk, other=0.0).to(tl.int32), 1, _N_TILE_FLAGS)
    M64 = M.to(tl.float64)
    s = tl.load(st_ptr + plane + off, mask=msk, other=0.0).to(tl.float64)
    live = s > 0
    dm = tl.where(live, m.to(tl.float64) - M64[:, None], 0.0)
    ea = tl.where(live, tl.exp(dm), 0.0)
    S = tl.sum(s * ea, 1)
    kz = tl.min(tl.where(msk & (m == M[:, None]), tj, NT), 1)  # the first tile holding the max
    T = tl.zeros([ROWS], tl.float64)
    if WANT_ENT:
        t = tl.load(st_ptr + 2 * plane + off, mask=msk, other=0.0).to(tl.float64)
        T = tl.sum(tl.where(live, ea * (t + dm * s), 0.0), 1)
    if HAS_REF:
        rm = tl.load(st_ptr + 5 * plane + off, mask=msk, other=ninf)
        RM = tl.max(rm, 1)
        RM64 = RM.to(tl.float64)
        rs = tl.load(st_ptr + 6 * plane + off, mask=msk, other=0.0).to(tl.float64)
        c = tl.load(st_ptr + 7 * plane + off, mask=msk, other=0.0).to(tl.float64)
        rlive = rs > 0
        drm = tl.where(rlive, rm.to(tl.float64) - RM64[:, None], 0.0)
        ar = tl.where(rlive, tl.exp(drm), 0.0)
        RS = tl.sum(rs * ar, 1)
        # the cross term moved to the common shifts (M, RM)
        C = tl.sum(tl.where(rlive, ar * (c + (drm - dm) * rs), 0.0), 1)
        kr = tl.min(tl.where(msk & (rm == RM[:, None]), tj, NT), 1)
    empty = (M == ninf) & ((flags & _F_INF) == 0)
    flags = flags | tl.where(counted & empty, _F_EMPTY, 0)
    ls = tl.log(S)
    kz = tl.where(counted & (kz < n_tiles), kz, 0)
    am = tl.load(st_ptr + 3 * plane + kz.to(tl.int64) * n_rows + rows64, mask=counted, other=0.0)
    amax = kz.to(tl.float64) * TILE + am.to(tl.float64)
    nll = tl.zeros([ROWS], tl.float64)
    if HAS_TGT:
        zt = tl.load(_at(z_ptr, g, z_inner, z_stride, z_outer) + tgt, mask=counted, other=0.0)
        nll = (M64 - _capped64(zt, cap, CAPPED)) + ls
    ent = ls - T / S
    tl.store(base + _O_NLL * n_total, tl.where(counted, _nonneg(nll), 0.0), mask=rmask)
    tl.store(base + _O_ENT * n_total, tl.where(counted, _nonneg(ent), 0.0), mask=rmask)
    tl.store(base + _O_AMAX * n_total, tl.where(counted, amax, -1.0), mask=rmask)
    # the top token's log-probability: (M - M) - log S, <= 0
    tl.store(base + _O_TOP * n_total, tl.where(counted, -_nonneg(ls), 0.0), mask=rmask)
    if HAS_REF:
        rempty = (RM == ninf) & ((flags & _F_INF_REF) == 0)
        flags = flags | tl.where(counted & rempty, _F_EMPTY_REF, 0)
        rls = tl.log(RS)
        kl = C / RS - rls + ls
        kr = tl.where(counted & (kr < n_tiles), kr, 0)
        ram = tl.load(st_ptr + 8 * plane + kr.to(tl.int64) * n_rows + rows64, mask=counted, other=0.0)
        ramax = kr.to(tl.float64) * TILE + ram.to(tl.float64)
        rnll = tl.zeros([ROWS], tl.float64)
        if HAS_TGT:
            rt = tl.load(_at(r_ptr, g, r_inner, r_stride, r_outer) + tgt, mask=counted, other=0.0)
            rnll = (RM64 - _capped64(rt, cap, CAPPED)) + rls
        tl.store(base + _O_KL * n_total, tl.where(counted, _nonneg(kl), 0.0), mask=rmask)
        tl.store(base + _O_RAMAX * n_total, tl.where(counted, ramax, -1.0), mask=rmask)
        tl.store(base + _O_RNLL * n_total, tl.where(counted, _nonneg(rnll), 0.0), mask=rmask)
    flags = tl.where(counted, flags | _F_COUNTED, 0)
    if HAS_TGT:
        flags = flags | tl.where(oob, _F_OOB | _F_COUNTED, 0)
    tl.store(base + _O_FLAGS * n_total, flags.to(tl.float64), mask=rmask)


# test hooks: a smaller tile, a fixed number of tiles a program
_tile = TILE
_per_prog: Optional[int] = None


_SMS: Dict[torch.device, int] = {}


def _sms(device: torch.device) -> int:
    """The device's multiprocessors (asked once a device)."""
    if device.type != "cuda":
        return 132
    n = _SMS.get(device)
    if n is None:
        import torch

        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _programs_per_row(n_rows: int, n_tiles: int, device: torch.device) -> int:
    """Tiles a program takes: whole rows when there are rows enough to fill
    the device several times over, else runs short enough that the
    programs do (few long rows). Changes no result."""
    if _per_prog is not None:
        return max(1, min(_per_prog, n_tiles))
    sms = _sms(device)
    want = 32 * sms  # programs: several waves, for an even finish
    per = max(1, min(n_tiles, (n_rows * n_tiles) // want))
    progs = -(-n_tiles // per)
    return -(-n_tiles // progs)  # the same number of tiles in each (63 tiles: 21, 21, 21, not 30, 30, 3)


class LaunchError(RuntimeError):
    """The kernels could not be compiled or launched (the caller falls back
    to the torch path)."""


def usable(lg: CudaLogits, ref: Optional[CudaLogits], rank: bool = False) -> bool:
    """Whether the Triton path takes these logits: 16- and 32-bit floats on
    both sides (the kernel works in float32: a float64 reference keeps the
    torch path, exact in float64) whose vocabulary axis is contiguous, and
    no rank asked (the torch path counts it)."""
    if rank:
        return False
    sides = [lg] if ref is None else [lg, ref]
    if any(x.dtype not in ("float32", "bfloat16", "float16") for x in sides) or lg.n_cols > _MAX_TILES * _tile:
        return False
    return all(x.keep.stride(-1) == 1 or x.n_cols == 1 for x in sides)


def compute(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, res: torch.Tensor,
            targets: Optional[torch.Tensor], ignore: int, cap: float) -> None:
    """The kernels' per-row values and flags into res, on the device (the
    targets: a tensor there, read there, rows counted where neither
    negative nor ignore); nothing waits for the device."""
    import torch

    dev = lg.keep.device
    n = lg.n_rows
    tile = _tile
    n_tiles = (lg.n_cols + tile - 1) // tile
    group = max(1, min(_STATE_BYTES, chunk_bytes() // 2) // (n_tiles * _NFIELDS * 4))
    states = torch.empty((_NFIELDS, n_tiles, min(group, n)), dtype=torch.float32, device=dev)
    try:
        # on the tensors' device (the launch goes to the current one), and
        # the interpreter's numpy sees -inf - -inf in masked lanes
        with torch.cuda.device(dev) if dev.type == "cuda" and dev != _current(dev) else contextlib.nullcontext(), \
                np.errstate(all="ignore") if INTERPRET else contextlib.nullcontext():
            _launch(lg, ref, targets, ignore, res, states, group, n_tiles, tile, ref is not None,
                    out.entropy is not None, out.argmax is not None, cap)
    except Exception as e:
        raise LaunchError(str(e)) from e


def _current(dev: torch.device) -> torch.device:
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _rows_of(x: Optional[torch.Tensor], lg: CudaLogits) -> Tuple[int, int, int]:
    """(inner, stride, outer) of a targets tensor of lg's leading shape, or flat."""
    if x is None:
        return (1, 0, 0)
    shape = tuple(int(k) for k in x.shape)
    rows = collapse(shape, x.stride())
    assert rows is not None, "lmmetrics: internal error: targets no two strides describe"
    return rows[1:]


def _launch(lg: CudaLogits, ref: Optional[CudaLogits], targets: Optional[torch.Tensor], ignore: int,
            res: torch.Tensor, states: torch.Tensor, group: int, n_tiles: int, tile: int, has_ref: bool,
            want_ent: bool, want_amax: bool, cap: float) -> None:
    dev = lg.keep.device
    n = lg.n_rows
    V = lg.n_cols
    capf = float(cap) if cap else 1.0
    inv_hi = float(np.float32(1.0 / capf))
    inv_lo = float(np.float32(1.0 / capf - inv_hi))
    nt = triton.next_power_of_2(n_tiles)
    z = lg.keep
    r = z if ref is None else ref.keep
    zr = lg.rows
    rr = zr if ref is None else ref.rows
    tg = z if targets is None else targets
    tr = _rows_of(targets, lg)
    for row0 in range(0, n, group):
        rows = min(group, n - row0)
        st = states if rows == states.shape[2] else \
            states.view(-1)[: _NFIELDS * n_tiles * rows].view(_NFIELDS, n_tiles, rows)
        per = _programs_per_row(rows, n_tiles, dev)
        grid = (rows, (n_tiles + per - 1) // per)
        _tiles[grid](z, r, tg, st, row0, rows, V, *zr, *rr, *tr, ignore, n_tiles, per,
                     capf, inv_hi, inv_lo, TILE=tile, HAS_TGT=targets is not None, HAS_REF=has_ref,
                     WANT_ENT=want_ent, WANT_AMAX=want_amax, CAPPED=bool(cap), num_warps=NUM_WARPS)
        mrows = max(1, min(16, _MERGE_ELEMS // nt))
        _merge[((rows + mrows - 1) // mrows,)](
            st, z, r, tg, res, rows, row0, n, V, n_tiles, *zr, *rr, *tr, ignore,
            capf, 1.0 / capf, TILE=tile, ROWS=mrows, NT=nt, HAS_TGT=targets is not None,
            HAS_REF=has_ref, WANT_ENT=want_ent, CAPPED=bool(cap), num_warps=4)
