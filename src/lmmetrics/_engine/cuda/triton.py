"""CUDA tensors through Triton: every per-row value in one read of the logits.

The vocabulary axis is cut into spans of ``SPAN`` elements. The first
kernel (``_spans``) reduces each (row, span) to a small state, in float32:
the span's max m, the sums s = sum e, e = exp(z - m), and t = sum e (z - m)
(entropy), the first column of the max, the count of logits ranking before
the target's (above it, or equal to it at a lower column: the rank), flags
(NaN, +inf); with a reference buffer, read in the same pass, its max, sum,
first argmax and the KL cross term c = sum e_r ((r - rm) - (z - m)). A
softcap c tanh(z / c) is applied on the fly. Inside a span, each thread
owns lane-rows of 16 contiguous bytes of every tile and keeps a running
(max, sums) for each, reduced inside the thread; the reductions across
threads run once a span, not once a tile (one exp an element, and 1/VEC
more for the rescaling). The second kernel (``_merge``) combines a row's
span states in float64, in a fixed order, and writes the per-row values.
A program of the first kernel takes a run of consecutive spans of one row,
so few long rows still spread over many programs; the states, and so the
results, depend only on the layout of the logits' dtype (``_LAYOUTS``),
never on how many spans a program takes, how many rows a launch holds, or
how many multiprocessors the device has. Extra memory: 40 bytes a span of
the rows in flight (bounded) and the pass's result buffer; no N x V
temporary.

Targets are read where they are: a row is counted when its target is
neither negative nor ``ignore_index``; a counted target not below the
vocabulary size is flagged (``F_OOB``), and its row not read. Ignored rows
are not read either. Rows that hold +inf, or whose KL cross term is beyond
float range (the model masks where the reference does not), are done again
by the exact torch path of `lmmetrics._engine.cuda`; NaN and all -inf rows
among the counted ones raise the native core's errors, naming the first
bad row. The per-row values, flags and targets go into the pass's buffer on
the device (`lmmetrics._engine.cuda.layout.N_RESULTS` values a row), which
`lmmetrics._engine.cuda` brings to the host once when the pass ends: no
launch waits for the device. float64 logits keep the torch path.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np

import triton
import triton.language as tl
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from .layout import (F_COUNTED, F_CROSS, F_EMPTY, F_EMPTY_REF, F_INF, F_INF_REF, F_NAN, F_NAN_REF, F_OOB, N_RESULTS,
                     RES_FLAGS, RES_TARGETS, SPAN_FLAGS, CudaLogits, chunk_bytes, row, rows_of)
from ..request import RowResults

if TYPE_CHECKING:
    import torch


# The layout of a pass, per dtype of the logits: VEC elements (16 bytes) a
# lane-row, LROWS = 32 x warps x (lane-rows a thread) lane-rows a tile,
# TPS tiles a span of SPAN elements. The results depend on it (and only
# on it: never on the rows a launch holds, the spans a program takes or
# the device), so every variant of a dtype (NLL, evaluate, KL, capped)
# shares it: cross_entropy(z, t) and evaluate(z, t).loss agree to the bit.
# (dtype: VEC, warps, lane-rows a thread, TPS); SPAN = 16384 for each.
_LAYOUTS = {"bfloat16": (8, 8, 2, 4), "float16": (8, 8, 2, 4), "float32": (4, 4, 4, 8)}
SPAN = 16384
# The merge kernel loads all spans of ROWS rows at once: ROWS x NS
# (NS = n_spans to a power of 2) at most this many; rows whose vocabulary
# needs more spans (or columns past float32's exact integers, 2^24, where
# a state holds an argmax) keep the torch path.
_MERGE_ELEMS = 1024
_MAX_COLS = 2**24
# Bound on the span states of the rows in flight, and half the CUDA chunk
# setting at most (rows are launched in groups that fit; the outputs still
# come back in one transfer).
_STATE_BYTES = 64 * 2**20
_NFIELDS = 10  # m, s, t, am, flags, rm, rs, c, ram, rank
_F_NAN, _F_INF, _F_NAN_REF, _F_INF_REF, _F_CROSS, _F_EMPTY, _F_EMPTY_REF, _F_COUNTED, _F_OOB = (
    tl.constexpr(f) for f in (F_NAN, F_INF, F_NAN_REF, F_INF_REF, F_CROSS, F_EMPTY, F_EMPTY_REF, F_COUNTED, F_OOB))
_N_SPAN_FLAGS = tl.constexpr(len(SPAN_FLAGS))
# KL cross-term lanes beyond this take the exact path (as LM_CROSS_BIG)
_CROSS_BIG = tl.constexpr(1e20)
_LOG2E = tl.constexpr(1.4426950408889634)
_NEG_BIG = tl.constexpr(-1e30)
# output rows of the (N_RESULTS, N) float64 result (layout.row)
_O_FLAGS, _O_TARGETS = tl.constexpr(RES_FLAGS), tl.constexpr(RES_TARGETS)
_O_NLL, _O_ENT, _O_AMAX, _O_KL, _O_RAMAX, _O_RNLL, _O_TOP, _O_RANK = (
    tl.constexpr(row(name)) for name in ("nll", "entropy", "argmax", "kl", "ref_argmax", "ref_nll", "top_logprob",
                                         "rank"))
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
def _counted(t: tl.tensor, ignore: tl.tensor) -> tl.tensor:
    """Whether a row with target t is counted (neither negative nor ignore)."""
    return (t >= 0) & (t != ignore)


@triton.jit
def _live(t: tl.tensor, ignore: tl.tensor, n_cols: tl.tensor) -> tl.tensor:
    """Whether a row with target t is counted and its target can be read."""
    return _counted(t, ignore) & (t < n_cols)


@triton.jit
def _any_bits(fl: tl.tensor, axis: tl.constexpr, NBITS: tl.constexpr) -> tl.tensor:
    """The OR of the flags along axis (a max a bit: the interpreter runs a
    custom combine function element by element)."""
    acc = tl.max(fl & 1, axis)
    for b in tl.static_range(1, NBITS):
        acc = acc | (tl.max((fl >> b) & 1, axis) << b)
    return acc


@triton.jit
def _values(row_ptr: tl.tensor, cols: tl.tensor, n_cols: tl.tensor, cap: tl.tensor, cap_lo: tl.tensor,
            inv_cap: tl.tensor, inv_lo: tl.tensor, CAPPED: tl.constexpr) -> tl.tensor:
    """A row's logits at cols in float32 (-inf past the vocabulary), capped
    c tanh(x / c) with CAPPED (c = cap + cap_lo, 1 / c = inv_cap + inv_lo:
    each to twice float precision); read once, so not kept in the cache."""
    mask = cols < n_cols
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    if CAPPED:
        # x / c as x (hi + lo), hi + lo = 1 / c to twice float precision: x
        # times a rounded 1 / c would bias every capped logit one way (where
        # tanh is +-1 anyway, +-inf and huge x, the plain product); and c
        # tanh(u) as tanh(u) (hi + lo) for the same reason (a c not exact in
        # float, 77.7: 4e-8 of every capped logit, the summed NLL's bias)
        u = x * inv_cap
        u = tl.where(tl.abs(u) < 1e30, tl.fma(x, inv_cap, x * inv_lo), u)
        th = _tanh(u)
        x = tl.where(mask, tl.fma(th, cap, th * cap_lo), float("-inf"))
    return x


@triton.jit
def _shift(x: tl.tensor, m: tl.tensor) -> tl.tuple:
    """A lane-row's running max m (one value a lane-row) after the values x
    (lane-rows x VEC, reduced inside each thread): the new max, the shift
    the sums are taken against (0 for -inf), the factor the old sums are
    scaled by (0 where there were none: it multiplies, so a NaN stays NaN),
    the old shift, and the values' own max."""
    xm = tl.max(x, axis=1)
    m_new = tl.maximum(m, xm)
    ms = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.where(m == float("-inf"), 0.0, tl.math.exp2((m - m_new) * _LOG2E))
    mo = tl.where(m == float("-inf"), 0.0, m)
    return m_new, ms, a, mo, xm


@triton.jit
def _first_max(row_ptr: tl.tensor, m: tl.tensor, M: tl.tensor, bt: tl.tensor, lr: tl.tensor, col0: tl.tensor,
               n_cols: tl.tensor, cap: tl.tensor, cap_lo: tl.tensor, inv_cap: tl.tensor, inv_lo: tl.tensor,
               VEC: tl.constexpr, TILE: tl.constexpr, CAPPED: tl.constexpr) -> tl.tensor:
    """The first column of a span holding its max M: the first VEC-wide
    block (the tile a lane-row first reached its max, bt, and the
    lane-row) read again, its first largest value (the block's own max:
    equal to M, whatever rounding the two reads of a capped value took)."""
    blk = tl.min(tl.where(m == M, bt * TILE + lr * VEC, 2147483647), axis=0)
    blk = tl.where(blk == 2147483647, 0, blk)  # (no lane holds M: a NaN row, an error)
    v = tl.arange(0, VEC)
    xv = _values(row_ptr, col0 + blk + v, n_cols, cap, cap_lo, inv_cap, inv_lo, CAPPED)
    return col0 + blk + tl.min(tl.where(xv == tl.max(xv, axis=0), v, VEC), axis=0)


# (counts that vary from call to call are not specialized on: a row, a span
# or a program's one span would each compile the kernel again)
@triton.jit(do_not_specialize=("row0", "n_rows", "n_spans", "per_prog", "ignore"))
def _spans(z_ptr: tl.tensor, r_ptr: tl.tensor, tgt_ptr: tl.tensor, st_ptr: tl.tensor, row0: tl.tensor,
           n_rows: tl.tensor, n_cols: tl.tensor, z_inner: tl.tensor, z_stride: tl.tensor, z_outer: tl.tensor,
           r_inner: tl.tensor, r_stride: tl.tensor, r_outer: tl.tensor, t_inner: tl.tensor, t_stride: tl.tensor,
           t_outer: tl.tensor, ignore: tl.tensor, n_spans: tl.tensor, per_prog: tl.tensor, cap: tl.tensor,
           cap_lo: tl.tensor, inv_cap: tl.tensor, inv_lo: tl.tensor, VEC: tl.constexpr, LROWS: tl.constexpr,
           TPS: tl.constexpr, HAS_TGT: tl.constexpr, HAS_REF: tl.constexpr, WANT_ENT: tl.constexpr,
           WANT_AMAX: tl.constexpr, WANT_RANK: tl.constexpr, CAPPED: tl.constexpr) -> None:
    """The states of spans [first, first + per_prog) of row row0 + row (see
    the module's docstring); program (row, j) starts at span j * per_prog."""
    row = tl.program_id(0).to(tl.int64)
    g = row0 + row
    first = tl.program_id(1) * per_prog
    TILE: tl.constexpr = LROWS * VEC
    plane = n_spans * n_rows  # fields of the states (bounded: int32)
    n_run = per_prog
    zrow = _at(z_ptr, g, z_inner, z_stride, z_outer)
    rrow = _at(r_ptr, g, r_inner, r_stride, r_outer)
    target = tl.program_id(0).to(tl.int64) * 0 - 1
    if HAS_TGT:  # a row not counted (or with a target out of range) is not read, nor are its states
        target = tl.load(_at(tgt_ptr, g, t_inner, t_stride, t_outer)).to(tl.int64)
        live = _live(target, ignore, n_cols)
        n_run = tl.where(live, per_prog, 0)
        target = tl.where(live, target, 0)
    zt = 0.0
    t32 = target.to(tl.int32)  # (< n_cols when read: int32 compares in the loop)
    if WANT_RANK:  # the target's logit, as the loop reads it
        zt = _values(zrow, target, n_cols, cap, cap_lo, inv_cap, inv_lo, CAPPED)
    lr = tl.arange(0, LROWS)
    offs = lr[:, None] * VEC + tl.arange(0, VEC)[None, :]
    ninf = float("-inf")
    for j in range(0, n_run):
        span = first + j
        if span < n_spans:
            col0 = span * (TPS * TILE)
            m = tl.full([LROWS], ninf, tl.float32)
            s = tl.zeros([LROWS], tl.float32)
            ta = tl.zeros([LROWS], tl.float32)
            bt = tl.zeros([LROWS], tl.int32)
            cnt = tl.zeros([LROWS], tl.int32)
            rm = tl.full([LROWS], ninf, tl.float32)
            rs = tl.zeros([LROWS], tl.float32)
            c = tl.zeros([LROWS], tl.float32)
            rbt = tl.zeros([LROWS], tl.int32)
            big = tl.full([LROWS], ninf, tl.float32)
            for k in tl.range(0, TPS):
                cols = col0 + k * TILE + offs
                x = _values(zrow, cols, n_cols, cap, cap_lo, inv_cap, inv_lo, CAPPED)
                m_new, ms, a, mo, xm = _shift(x, m)
                d = x - ms[:, None]
                if WANT_ENT or HAS_REF:  # -inf as -1e30: e d = 0, not NaN; a NaN stays NaN
                    d = tl.maximum(d, _NEG_BIG, propagate_nan=tl.PropagateNan.ALL)
                e = tl.math.exp2(d * _LOG2E)
                if WANT_ENT:
                    ta = a * (ta + tl.maximum(mo - ms, _NEG_BIG) * s) + tl.sum(e * d, axis=1)
                if WANT_AMAX:
                    bt = tl.where(xm > m, k, bt)
                if WANT_RANK:  # above the target's value, or equal to it before its column
                    lo = t32 - (col0 + k * TILE)  # (offs < lo: the columns before the target's)
                    before = (x > zt) | ((x == zt) & (offs < lo))
                    if CAPPED:  # (the target's own value, capped by other code, may differ in its last bit)
                        before = before & (offs != lo)
                    cnt += tl.sum(before.to(tl.int32), axis=1)
                if HAS_REF:
                    y = _values(rrow, cols, n_cols, cap, cap_lo, inv_cap, inv_lo, CAPPED)
                    rm_new, rms, ra, rmo, ym = _shift(y, rm)
                    dr = tl.maximum(y - rms[:, None], _NEG_BIG, propagate_nan=tl.PropagateNan.ALL)
                    er = tl.math.exp2(dr * _LOG2E)
                    # c = sum e_r ((r - rm) - (z - m)), moved to both sides' new shifts: the model's move
                    # as it is, times the reference's old mass rs ra (a lane-row of finfo.min, then
                    # logits: 3.4e38 times that mass, the KL's own size; clamped at 1e30, the KL came
                    # back 1e8 times too small), past float inf or NaN and so the exact path (C below);
                    # the reference's move clamped, where ra is 0 (no old mass left, no inf times 0)
                    c = tl.fma(tl.maximum(rmo - rms, _NEG_BIG) - (mo - ms), rs * ra,
                               tl.fma(c, ra, tl.sum(er * (dr - d), axis=1)))
                    # a term beyond float (the model masks where the reference does not): the exact path
                    big = tl.maximum(big, tl.max(tl.where(y > ninf, dr - d, ninf), axis=1))
                    rs = tl.fma(rs, ra, tl.sum(er, axis=1))
                    if WANT_AMAX:
                        rbt = tl.where(ym > rm, k, rbt)
                    rm = rm_new
                s = s * a + tl.sum(e, axis=1)
                m = m_new
            # once a span: the reductions across lane-rows
            M = tl.max(m, axis=0)
            Ms = tl.where(M == ninf, 0.0, M)
            w = tl.where(m == ninf, 0.0, tl.math.exp2((m - Ms) * _LOG2E))
            S = tl.sum(s * w, axis=0)
            at = st_ptr + span.to(tl.int64) * n_rows + row
            tl.store(at, M)
            tl.store(at + plane, S)
            # a NaN or +inf anywhere in the span reaches S (and +inf M)
            flags = tl.where(S != S, _F_NAN, 0) | tl.where(M == float("inf"), _F_INF, 0)
            if WANT_ENT:
                mo = tl.where(m == ninf, 0.0, m)
                tl.store(at + 2 * plane, tl.sum(w * (ta + tl.maximum(mo - Ms, _NEG_BIG) * s), axis=0))
            if WANT_AMAX:
                am = _first_max(zrow, m, M, bt, lr, col0, n_cols, cap, cap_lo, inv_cap, inv_lo, VEC, TILE, CAPPED)
                tl.store(at + 3 * plane, am.to(tl.float32))
            if WANT_RANK:
                tl.store(at + 9 * plane, tl.sum(cnt, axis=0).to(tl.float32))
            if HAS_REF:
                RM = tl.max(rm, axis=0)
                RMs = tl.where(RM == ninf, 0.0, RM)
                rw = tl.where(rm == ninf, 0.0, tl.math.exp2((rm - RMs) * _LOG2E))
                RS = tl.sum(rs * rw, axis=0)
                rmo = tl.where(rm == ninf, 0.0, rm)
                mo = tl.where(m == ninf, 0.0, m)
                C = tl.sum(rw * c + (tl.maximum(rmo - RMs, _NEG_BIG) - (mo - Ms)) * (rs * rw), axis=0)  # (as c)
                tl.store(at + 5 * plane, RM)
                tl.store(at + 6 * plane, RS)
                tl.store(at + 7 * plane, C)
                if WANT_AMAX:
                    ram = _first_max(rrow, rm, RM, rbt, lr, col0, n_cols, cap, cap_lo, inv_cap, inv_lo, VEC, TILE,
                                     CAPPED)
                    tl.store(at + 8 * plane, ram.to(tl.float32))
                flags = flags | tl.where(RS != RS, _F_NAN_REF, 0) | tl.where(RM == float("inf"), _F_INF_REF, 0) \
                    | tl.where((C - C != 0.0) | (tl.max(big, axis=0) > _CROSS_BIG), _F_CROSS, 0)
            tl.store(at + 4 * plane, flags.to(tl.float32))


@triton.jit
def _capped64(v: tl.tensor, cap: tl.tensor, cap_lo: tl.tensor, CAPPED: tl.constexpr) -> tl.tensor:
    """A target's logit, capped in float64 (c = cap + cap_lo, the cap to
    twice float precision: a cap not exact in float, rounded, would move
    the target's logit against the sum's; divided by c rather than times
    1 / c)."""
    v = v.to(tl.float64)
    if CAPPED:
        c = tl.cast(cap, tl.float64) + tl.cast(cap_lo, tl.float64)
        v = c * _tanh(v / c)
    return v


@triton.jit
def _nonneg(v: tl.tensor) -> tl.tensor:
    """v, 0 where rounding made it negative; a NaN stays NaN (the host
    sends such a row to the exact path: tl.maximum would turn it into 0)."""
    return tl.where(v < 0, 0.0, v)


@triton.jit(do_not_specialize=("n_rows", "row0", "n_total", "n_spans", "ignore"))
def _merge(st_ptr: tl.tensor, z_ptr: tl.tensor, r_ptr: tl.tensor, tgt_ptr: tl.tensor, out_ptr: tl.tensor,
           n_rows: tl.tensor, row0: tl.tensor, n_total: tl.tensor, n_cols: tl.tensor, n_spans: tl.tensor,
           z_inner: tl.tensor, z_stride: tl.tensor, z_outer: tl.tensor, r_inner: tl.tensor, r_stride: tl.tensor,
           r_outer: tl.tensor, t_inner: tl.tensor, t_stride: tl.tensor, t_outer: tl.tensor, ignore: tl.tensor,
           cap: tl.tensor, cap_lo: tl.tensor, ROWS: tl.constexpr, NS: tl.constexpr, HAS_TGT: tl.constexpr,
           HAS_REF: tl.constexpr, WANT_ENT: tl.constexpr, WANT_RANK: tl.constexpr, CAPPED: tl.constexpr) -> None:
    """Per-row values from the span states of ROWS rows, combined in float64
    by a fixed reduction over the spans (NS: n_spans to a power of 2); with
    targets, each row's flags F_COUNTED / F_OOB and its target."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    g = row0 + rows64
    plane = n_spans * n_rows
    tgt = tl.zeros([ROWS], tl.int64)
    counted = rmask
    oob = rows < 0
    base = out_ptr + g
    if HAS_TGT:
        tgt = tl.load(_at(tgt_ptr, g, t_inner, t_stride, t_outer), mask=rmask, other=-1).to(tl.int64)
        tl.store(base + _O_TARGETS * n_total, tgt.to(tl.float64), mask=rmask)
        counted = rmask & _counted(tgt, ignore)
        oob = counted & (tgt >= n_cols)
        counted = counted & (tgt < n_cols)  # (_live: the rows read)
    tgt = tl.where(counted, tgt, 0)
    ninf = float("-inf")
    # all of a row's spans at once (no loop: triton 3.7's thread-locality
    # pass fails on reductions accumulated across loop iterations)
    tj = tl.arange(0, NS)
    msk = counted[:, None] & (tj < n_spans)[None, :]
    off = tj[None, :].to(tl.int64) * n_rows + rows64[:, None]
    m = tl.load(st_ptr + off, mask=msk, other=ninf)
    M = tl.max(m, 1)
    flags = _any_bits(tl.load(st_ptr + 4 * plane + off, mask=msk, other=0.0).to(tl.int32), 1, _N_SPAN_FLAGS)
    # +inf makes a span's sum NaN (inf - inf): NaN there only without it
    flags = tl.where((flags & _F_INF) != 0, flags & ~_F_NAN, flags)
    flags = tl.where((flags & _F_INF_REF) != 0, flags & ~_F_NAN_REF, flags)
    M64 = M.to(tl.float64)
    s = tl.load(st_ptr + plane + off, mask=msk, other=0.0).to(tl.float64)
    live = s > 0
    dm = tl.where(live, m.to(tl.float64) - M64[:, None], 0.0)
    ea = tl.where(live, tl.exp(dm), 0.0)
    S = tl.sum(s * ea, 1)
    kz = tl.min(tl.where(msk & (m == M[:, None]), tj, NS), 1)  # the first span holding the max
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
        kr = tl.min(tl.where(msk & (rm == RM[:, None]), tj, NS), 1)
    empty = (M == ninf) & ((flags & _F_INF) == 0)
    flags = flags | tl.where(counted & empty, _F_EMPTY, 0)
    ls = tl.log(S)
    kz = tl.where(counted & (kz < n_spans), kz, 0)
    amax = tl.load(st_ptr + 3 * plane + kz.to(tl.int64) * n_rows + rows64, mask=counted, other=0.0).to(tl.float64)
    nll = tl.zeros([ROWS], tl.float64)
    if HAS_TGT:
        zt = tl.load(_at(z_ptr, g, z_inner, z_stride, z_outer) + tgt, mask=counted, other=0.0)
        nll = (M64 - _capped64(zt, cap, cap_lo, CAPPED)) + ls
    ent = ls - T / S
    tl.store(base + _O_NLL * n_total, tl.where(counted, _nonneg(nll), 0.0), mask=rmask)
    tl.store(base + _O_ENT * n_total, tl.where(counted, _nonneg(ent), 0.0), mask=rmask)
    tl.store(base + _O_AMAX * n_total, tl.where(counted, amax, -1.0), mask=rmask)
    # the top token's log-probability: (M - M) - log S, <= 0
    tl.store(base + _O_TOP * n_total, tl.where(counted, -_nonneg(ls), 0.0), mask=rmask)
    if WANT_RANK:
        rank = tl.sum(tl.load(st_ptr + 9 * plane + off, mask=msk, other=0.0).to(tl.float64), 1)
        tl.store(base + _O_RANK * n_total, tl.where(counted, rank, -1.0), mask=rmask)
    if HAS_REF:
        rempty = (RM == ninf) & ((flags & _F_INF_REF) == 0)
        flags = flags | tl.where(counted & rempty, _F_EMPTY_REF, 0)
        rls = tl.log(RS)
        kl = C / RS - rls + ls
        kr = tl.where(counted & (kr < n_spans), kr, 0)
        ramax = tl.load(st_ptr + 8 * plane + kr.to(tl.int64) * n_rows + rows64, mask=counted, other=0.0).to(tl.float64)
        rnll = tl.zeros([ROWS], tl.float64)
        if HAS_TGT:
            rt = tl.load(_at(r_ptr, g, r_inner, r_stride, r_outer) + tgt, mask=counted, other=0.0)
            rnll = (RM64 - _capped64(rt, cap, cap_lo, CAPPED)) + rls
        tl.store(base + _O_KL * n_total, tl.where(counted, _nonneg(kl), 0.0), mask=rmask)
        tl.store(base + _O_RAMAX * n_total, tl.where(counted, ramax, -1.0), mask=rmask)
        tl.store(base + _O_RNLL * n_total, tl.where(counted, _nonneg(rnll), 0.0), mask=rmask)
    flags = tl.where(counted, flags | _F_COUNTED, 0)
    if HAS_TGT:
        flags = flags | tl.where(oob, _F_OOB | _F_COUNTED, 0)
    tl.store(base + _O_FLAGS * n_total, flags.to(tl.float64), mask=rmask)


# One launch without Triton's binder. ``kernel[grid](...)`` costs the host
# ~20 us a launch (measured on a 2-core VM with the driver's own launch
# stubbed): it types and specializes every argument, builds a cache key
# from them and looks the compiled kernel up. A pass launches two kernels,
# and an 8-row pass takes tens of microseconds of GPU time, so that cost
# is the call's. Here the first launch of a specialization goes through
# Triton (which compiles it), and the compiled kernel is kept under a key
# at least as fine as Triton's: each tensor's dtype and 16-byte alignment,
# each integer's type, whether it is 1, divisible by 16, within int32 and
# within 64 bits (Triton specializes on no more than these, and refuses an
# integer past 64 bits), the constexprs, the warps,
# the device and the settings Triton reads at each launch (debug,
# instrumentation). In front of it, the arguments' values seen (integers as
# they are: classifying each costs the host ~2 us a launch) go to their
# kernel, up to _MAX_SEEN of them (then forgotten: a value not seen is
# classified again). Later launches call the compiled kernel's launcher
# with the arguments Triton's own launch passes it (launch hooks and their
# metadata included: profilers see the same launches; without a hook, as a
# Triton without hooks passes, none and no metadata, whose building cost
# ~2 us a launch). The shape of
# that call is Triton's (runtime/jit.py, JITFunction.run), checked for the
# versions named here against Triton's own launch on a stubbed driver
# (tests/cuda/test_triton.py: group_direct_launch, group_direct_launch_probe);
# other versions, the interpreter, a pre-run hook or a stage inspection
# hook take Triton's launch every time.
_DIRECT_VERSIONS = ("3.6.", "3.7.", "3.8.", "3.9.")
# Compile options said, not left to Triton's defaults: a*b + c fused into
# one rounding (FMA), as the kernels' accuracy, bits and instruction counts
# were checked with (Triton 3.9 warns that its default turns to unfused in
# 3.10)
_OPTIONS = {"enable_fp_fusion": True}
_direct = not INTERPRET and triton.__version__.startswith(_DIRECT_VERSIONS)
_compiled: Dict[Tuple[Any, ...], Any] = {}  # Triton's specializations launched: their kernels
_seen: Dict[Tuple[Any, ...], Any] = {}  # the arguments' values seen: their kernels
_MAX_SEEN = 4096


def _run(fn: Any, grid: Tuple[int, ...], args: Tuple[Any, ...], cons: Dict[str, Any], warps: int) -> None:
    """fn[grid](*args, **cons, num_warps=warps), past Triton's binder when a
    launch of the same specialization went through it before (above)."""
    seen = spec = device = None
    if _direct and isinstance(fn, JITFunction) and not fn.pre_run_hooks and \
            knobs.runtime.add_stages_inspection_hook is None:
        device = driver.active.get_current_device()
        # the settings Triton adds to its options; an integer: its value; a
        # float: fp32 (keyed by its type, which no integer equals); a
        # tensor: its type, dtype and alignment (inline: a function call an
        # argument would cost what the binder does; anything else, a bool or
        # a numpy scalar, has no data_ptr: Triton's launch)
        head = (id(fn), device, warps, fn.debug or knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                getattr(knobs.compilation, "fpsan_homomorphic_casts", None), tuple(cons.items()))
        try:
            seen = (*head, *[a if type(a) is int else float if type(a) is float
                             else (type(a), a.dtype, (a.data_ptr() & 15) == 0) for a in args])
        except AttributeError:
            pass
    kernel = None if seen is None else _seen.get(seen)
    if kernel is None and seen is not None:
        # an integer: is 1, divisible by 16, int32, below 2^63 (Triton's
        # specialization), within 64 bits (past them Triton refuses it: no
        # kernel of an integer within them, whose launcher may wrap it); the
        # rest as above
        spec = (*head, *[(a == 1) | ((a & 15) == 0) << 1 | (-0x80000000 <= a <= 0x7FFFFFFF) << 2
                         | (a < 0x8000000000000000) << 3 | (-0x8000000000000000 <= a <= 0xFFFFFFFFFFFFFFFF) << 4
                         if type(a) is int else k for a, k in zip(args, seen[len(head):])])
        kernel = _compiled.get(spec)
        if kernel is not None:
            _remember(seen, kernel)
    if kernel is None:
        kernel = fn[grid](*args, **cons, num_warps=warps, **_OPTIONS)
        # (the launcher takes every parameter in the signature's order: the
        # kernels' constexprs come last, as cons names them)
        if spec is not None and kernel is not None and list(fn.arg_names[len(args):]) == list(cons):
            _compiled[spec] = kernel
            _remember(seen, kernel)
        return
    stream = driver.active.get_current_stream(device)
    full = (*args, *cons.values())
    g = (*grid, 1, 1)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _silent(enter) and _silent(leave):
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
    else:
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *full), enter, leave, *full)


_HOOK_CHAIN: Any = getattr(knobs, "HookChain", None)  # (newer Tritons' launch hooks: a chain, empty by default)


def _remember(seen: Any, kernel: Any) -> None:
    """seen's kernel, for its next launch (the values seen forgotten past
    _MAX_SEEN of them)."""
    if len(_seen) >= _MAX_SEEN:
        _seen.clear()
    _seen[seen] = kernel


def _silent(hook: Any) -> bool:
    """Whether a launch hook of Triton's settings calls nothing: None, or
    Triton's own empty chain of hooks (`HookChain`; not any other object
    with a ``calls`` list: a hook that records its calls there is called)."""
    return hook is None or (type(hook) is _HOOK_CHAIN and not hook.calls)


# test hooks: shorter spans (SPAN // _span of the default's lane-rows,
# 2 tiles a span), a fixed number of spans a program
_span = SPAN
_per_prog: Optional[int] = None


def geometry(dtype: str) -> Tuple[int, int, int, int]:
    """(VEC, LROWS, TPS, warps) of the layout of logits of dtype."""
    vec, warps, per_thread, tps = _LAYOUTS[dtype]
    if _span != SPAN:  # the test hook: spans of _span elements
        return vec, max(1, _span // (2 * vec)), 2, 1
    return vec, 32 * warps * per_thread, tps, warps


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


def _programs_per_row(n_rows: int, n_spans: int, device: torch.device) -> int:
    """Spans a program takes: whole rows when there are rows enough to fill
    the device several times over, else runs short enough that the
    programs do (few long rows). Changes no result."""
    if _per_prog is not None:
        return max(1, min(_per_prog, n_spans))
    want = 32 * _sms(device)  # programs: several waves, for an even finish
    per = max(1, min(n_spans, (n_rows * n_spans) // want))
    progs = -(-n_spans // per)
    return -(-n_spans // progs)  # the same number of spans in each (63 spans: 21, 21, 21, not 30, 30, 3)


class LaunchError(RuntimeError):
    """The kernels could not be compiled or launched (the caller falls back
    to the torch path)."""


def usable(lg: CudaLogits, ref: Optional[CudaLogits]) -> bool:
    """Whether the Triton path takes these logits: 16- and 32-bit floats on
    both sides (the kernel works in float32: a float64 reference keeps the
    torch path, exact in float64) whose vocabulary axis is contiguous."""
    if lg.n_cols > _MAX_COLS or -(-lg.n_cols // _span) > _MERGE_ELEMS:
        return False
    for x in (lg,) if ref is None else (lg, ref):
        if x.dtype not in _LAYOUTS or not (x.keep.stride(-1) == 1 or x.n_cols == 1):
            return False
    return True


_AS_IS = contextlib.nullcontext()  # (reusable: one for every launch)


def compute(lg: CudaLogits, ref: Optional[CudaLogits], out: RowResults, res: torch.Tensor,
            targets: Optional[torch.Tensor], ignore: int, cap: float) -> None:
    """The kernels' per-row values and flags into res, on the device (the
    targets: a tensor there, read there, rows counted where neither
    negative nor ignore); nothing waits for the device."""
    import torch

    dev = lg.keep.device
    n = lg.n_rows
    n_spans = -(-lg.n_cols // _span)
    group = max(1, min(_STATE_BYTES, chunk_bytes() // 2) // (n_spans * _NFIELDS * 4))
    states = torch.empty((_NFIELDS, n_spans, min(group, n)), dtype=torch.float32, device=dev)
    try:
        # on the tensors' device (the launch goes to the current one), and
        # the interpreter's numpy sees -inf - -inf in masked lanes
        with torch.cuda.device(dev) if dev.type == "cuda" and dev.index != torch.cuda.current_device() else _AS_IS, \
                np.errstate(all="ignore") if INTERPRET else _AS_IS:
            _launch(lg, ref, targets, ignore, res, states, group, n_spans, out, cap)
    except Exception as e:
        raise LaunchError(str(e)) from e


def _launch(lg: CudaLogits, ref: Optional[CudaLogits], targets: Optional[torch.Tensor], ignore: int,
            res: torch.Tensor, states: torch.Tensor, group: int, n_spans: int, out: RowResults, cap: float) -> None:
    dev = lg.keep.device
    n = lg.n_rows
    V = lg.n_cols
    # (cap and 1 / cap each as two float32s; numpy scalars cost the host a microsecond each)
    cap_hi, cap_lo, inv_hi, inv_lo = 1.0, 0.0, 1.0, 0.0
    if cap:
        cap_hi = float(np.float32(cap))
        cap_lo = float(np.float32(cap - cap_hi))
        inv_hi = float(np.float32(1.0 / cap))
        inv_lo = float(np.float32(1.0 / cap - inv_hi))
    ns = 1 << (n_spans - 1).bit_length()  # (n_spans to a power of 2; triton's own helper costs 2 us)
    vec, lrows, tps, warps = geometry(lg.dtype)
    z = lg.keep
    r = z if ref is None else ref.keep
    zr = lg.rows
    rr = zr if ref is None else ref.rows
    tg = z if targets is None else targets
    tr = (1, 0, 0) if targets is None else rows_of(targets, targets.dim())[1]  # (no copy: device_targets saw to it)
    has_tgt, has_ref, ent, amax, rank, capped = (targets is not None, ref is not None, out.entropy is not None,
                                                 out.argmax is not None, out.rank is not None, bool(cap))
    for row0 in range(0, n, group):
        rows = min(group, n - row0)
        st = states if rows == states.shape[2] else \
            states.view(-1)[: _NFIELDS * n_spans * rows].view(_NFIELDS, n_spans, rows)
        per = _programs_per_row(rows, n_spans, dev)
        grid = (rows, (n_spans + per - 1) // per)
        # (constexprs in the signature's order: see _run)
        _run(_spans, grid, (z, r, tg, st, row0, rows, V, *zr, *rr, *tr, ignore, n_spans, per, cap_hi, cap_lo, inv_hi,
              inv_lo),
             dict(VEC=vec, LROWS=lrows, TPS=tps, HAS_TGT=has_tgt, HAS_REF=has_ref, WANT_ENT=ent, WANT_AMAX=amax,
                  WANT_RANK=rank, CAPPED=capped), warps)
        mrows = max(1, min(16, _MERGE_ELEMS // ns))
        _run(_merge, ((rows + mrows - 1) // mrows,),
             (st, z, r, tg, res, rows, row0, n, V, n_spans, *zr, *rr, *tr, ignore, cap_hi, cap_lo),
             dict(ROWS=mrows, NS=ns, HAS_TGT=has_tgt, HAS_REF=has_ref, WANT_ENT=ent, WANT_RANK=rank, CAPPED=capped), 4)
