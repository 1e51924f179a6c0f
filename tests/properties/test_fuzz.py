"""Property fuzzing of every metric against independent float64 references.

Each hypothesis case is a plain description (:class:`Case`): dtype, shape,
memory layout, container (numpy, big-endian numpy, torch), a recipe for the
values (seeded random base plus special entries: -inf / +inf / NaN, finite
masks at finfo.min or -1e30, ties, huge maxima, denormals), targets (dtype,
ignore pattern, out-of-range entries), softcap, thread count and SIMD path.
The arrays are rebuilt from the description, so the example hypothesis
prints is the whole reproducer; ``values=`` / ``targets=`` give explicit
arrays for the regression examples.

The reference reads back the stored array (so the rounding to the storage
dtype is part of the input), casts it to float64, applies the softcap
c * tanh(z / c) in float64, then works on d = z - max(z) (exact for the
stored values): log p = d - log(sum exp d). +inf entries share the mass
equally, -inf entries have probability 0.

Tolerances (the library's contract): float32 / 16-bit inputs within
2e-6 + 1e-6 |ref| per row (NLL, entropy, KL), float64 within 1e-13 +
1e-13 |ref| (F64_TOL) on every SIMD path; sums and means within 1e-8
(float64: 1e-13) relative plus the rows' tolerances. With a softcap the kernel rounds the capped logits to its lane type
(float for 16/32-bit input), so a term of a few lane ulps of the largest
capped magnitude is added there.

Profiles (tests/conftest.py): ``ci`` (default) and ``long``
(``HYPOTHESIS_PROFILE=long``); see conftest for the example counts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import example, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import lmmetrics  # noqa: E402
from lmmetrics import _core  # noqa: E402
from helpers import BF16, is_bf16  # noqa: E402

torch = pytest.importorskip("torch")

ISAS = tuple(i for i in _core.ISAS if _core.isa_supported(i))
NP_DT = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
         "float16": np.dtype(np.float16), "bfloat16": BF16}
TORCH_DT = {"float32": torch.float32, "float64": torch.float64,
            "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = [k for k, v in NP_DT.items() if v is not None]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
TORCH_INT = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
             "int64": torch.int64, "uint8": torch.uint8}
LAYOUTS = ["contig", "contig", "shifted", "lead_step", "negstride", "transposed",
           "vocab_step", "fortran"]
# vector steps: 32 (AVX-512 float), 16 (AVX2), 2 (scalar); blocks 64 steps
EDGE_V = [1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 127, 128, 129, 255, 257,
          511, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4097, 6143, 8191, 8193]
TIE_VALUES = ["rowmax+1", 1e15, 1e17, 1e19, 3e38, 6e4, "max", 0.0]
SPECIAL_KINDS = ["-inf", "+inf", "nan", "fmin", "-1e30", "max", "-max", "row-inf", "mask-fmin",
                 "mask-inf", "tie", "tie", "denorm-max", "huge"]


def _finfo(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(ml_dtypes.bfloat16)
    return np.finfo(NP_DT[dtype])


# ----------------------------------------------------------------------------
# The description of one case and the arrays it stands for


@dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    lead: Tuple[int, ...] = (1,)
    V: int = 4
    layout: str = "contig"
    container: str = "numpy"        # numpy | bigendian | torch
    seed: int = 0
    base: str = "normal"            # normal | ramp | const | tiny | wide
    scale: float = 3.0
    specials: Tuple[tuple, ...] = ()
    softcap: Optional[float] = None
    threads: int = 1
    isa: str = ISAS[-1]
    ignore_index: int = -100
    tdtype: str = "int64"
    tcontainer: str = "numpy"       # numpy | torch | strided
    p_ignore: float = 0.0
    p_neg: float = 0.0
    p_oob: float = 0.0
    p_hit: float = 0.0
    values: Optional[tuple] = None  # explicit logical values (nested lists), overrides the recipe
    targets: Optional[tuple] = None  # explicit targets (nested lists of Python ints)
    ref: str = "none"               # KL / evaluate: none | same | perturbed | independent
    ref_seed: int = 1
    ref_specials: Tuple[tuple, ...] = ()
    ref_values: Optional[tuple] = None

    @property
    def n(self) -> int:
        return math.prod(self.lead)


def _tie_value(kind, row, dtype):
    if kind == "rowmax+1":
        fin = row[np.isfinite(row)]
        return (fin.max() + 1.0) if fin.size else 1.0
    if kind == "max":
        return float(_finfo(dtype).max)
    return float(kind)


def logical_values(c: Case, seed: int, specials, values) -> np.ndarray:
    """The intended float64 values, shape lead + (V,) (before storage rounding)."""
    shape = c.lead + (c.V,)
    if values is not None:
        return np.array(values, dtype=np.float64).reshape(shape)
    n, V = c.n, c.V
    rng = np.random.default_rng(seed)
    if c.base == "normal":
        z = rng.standard_normal((n, V)) * c.scale
    elif c.base == "ramp":  # maxima rising along the row: every block is redone
        z = np.linspace(-c.scale, c.scale, V)[None, :] + rng.standard_normal((n, V))
    elif c.base == "const":
        z = np.full((n, V), c.scale)
    elif c.base == "tiny":  # denormals of the storage dtype
        z = rng.integers(-8, 9, (n, V)) * float(_finfo(c.dtype).smallest_subnormal)
    else:  # wide: magnitudes over many decades
        z = rng.standard_normal((n, V)) * np.exp(rng.uniform(0, math.log(max(c.scale, 1.0)), (n, V)))
    fi = _finfo(c.dtype)
    if n:
        for sp in specials:
            kind, r, col, k, vi = sp
            r %= n
            col %= V
            row = z[r]
            if kind == "-inf":
                row[col] = -np.inf
            elif kind == "+inf":
                row[col] = np.inf
            elif kind == "nan":
                row[col] = np.nan
            elif kind == "fmin":
                row[col] = float(fi.min)
            elif kind == "-1e30":
                row[col] = -1e30
            elif kind == "max":
                row[col] = float(fi.max)
            elif kind == "-max":
                row[col] = -float(fi.max)
            elif kind == "row-inf":
                row[:] = -np.inf
            elif kind == "mask-fmin":
                row[col:col + k] = float(fi.min)
            elif kind == "mask-inf":
                row[col:col + k] = -np.inf
            elif kind == "tie":
                v = _tie_value(TIE_VALUES[vi % len(TIE_VALUES)], row, c.dtype)
                step = max(1, V // max(k, 1))
                row[[(col + j * step) % V for j in range(max(k, 2))]] = v
            elif kind == "denorm-max":
                row[:] = 0.0
                row[col] = float(fi.smallest_subnormal) * (1 + vi % 3)
            elif kind == "huge":
                row[col] = _tie_value(TIE_VALUES[vi % len(TIE_VALUES)], row, c.dtype)
            else:  # pragma: no cover
                raise AssertionError(kind)
    return z.reshape(shape)


def stored(c: Case, which: str = "logits") -> np.ndarray:
    """The array in the storage dtype (native byte order, C order)."""
    if which == "logits":
        z = logical_values(c, c.seed, c.specials, c.values)
    else:
        if c.ref == "same":
            return stored(c)
        if c.ref == "perturbed":
            z = logical_values(c, c.seed, c.specials, c.values)
            rng = np.random.default_rng(c.ref_seed)
            with np.errstate(invalid="ignore"):
                z = z + rng.standard_normal(z.shape) * 0.3
            if c.ref_specials:
                extra = logical_values(c, c.ref_seed, c.ref_specials, None)
                mask = ~np.isfinite(extra) | (np.abs(extra) > 1e6)
                z = np.where(mask, extra, z)
        else:
            z = logical_values(c, c.ref_seed, c.ref_specials, c.ref_values)
    with np.errstate(over="ignore", invalid="ignore"):
        return z.astype(NP_DT[c.dtype])


def _nan_like(shape, dtype):
    return np.full(shape, np.nan, dtype=np.float64).astype(dtype)


def place(a: np.ndarray, layout: str, container: str):
    """An object holding the values of ``a`` in the given layout; entries of
    the storage outside the view are NaN (reading them would be a bug)."""
    lead = a.shape[:-1]
    if container == "torch" and layout == "negstride":
        layout = "lead_step"
    if layout in ("shifted", "lead_step") and not lead:
        layout = "contig"
    if layout == "contig":
        S, view = a.copy(), (lambda s: s)
    elif layout == "fortran":
        S, view = np.asfortranarray(a), (lambda s: s)
    elif layout == "shifted":  # logits[..., :-1, :]
        S = _nan_like(lead[:-1] + (lead[-1] + 1, a.shape[-1]), a.dtype)
        S[..., :-1, :] = a
        view = lambda s: s[..., :-1, :]
    elif layout == "lead_step":
        S = _nan_like((lead[0] * 2,) + a.shape[1:], a.dtype)
        S[::2] = a
        view = lambda s: s[::2]
    elif layout == "negstride":
        S = np.ascontiguousarray(a[::-1])
        view = lambda s: s[::-1]
    elif layout == "transposed":
        if len(lead) >= 2:
            S = np.ascontiguousarray(a.swapaxes(0, 1))
            view = lambda s: s.swapaxes(0, 1)
        else:  # the whole matrix transposed: the vocabulary axis is strided
            S = np.ascontiguousarray(a.T)
            view = lambda s: s.T
    elif layout == "vocab_step":
        S = _nan_like(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        S[..., ::2] = a
        view = lambda s: s[..., ::2]
    else:  # pragma: no cover
        raise AssertionError(layout)
    if container == "bigendian":
        S = S.astype(S.dtype.newbyteorder(">"), order="K")
    elif container == "torch":
        if is_bf16(S.dtype):
            S = torch.from_numpy(S.view(np.int16)).view(torch.bfloat16)
        else:
            S = torch.from_numpy(S)
    out = view(S)
    if container == "bigendian":
        assert out.dtype.byteorder == ">"
    return out


def _tmax(tdtype):
    return int(np.iinfo(np.dtype(tdtype)).max)


def _tmin(tdtype):
    return int(np.iinfo(np.dtype(tdtype)).min)


def logical_targets(c: Case, z64: np.ndarray) -> list:
    """Targets as Python ints (flattened)."""
    if c.targets is not None:
        return [int(v) for v in np.array(c.targets, dtype=object).reshape(-1)]
    n, V = c.n, c.V
    rng = np.random.default_rng(c.seed + 7919)
    lo, hi = _tmin(c.tdtype), _tmax(c.tdtype)
    out = []
    negs = [v for v in (-1, -2, -100, -7, lo) if lo <= v < 0]
    oobs = [v for v in (V, V + 1, V + 1000, hi, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 100) if V <= v <= hi]
    for i in range(n):
        u = rng.random()
        t = int(rng.integers(0, min(V, hi + 1)))
        if u < c.p_ignore:
            if lo <= c.ignore_index <= hi:
                t = c.ignore_index
        elif u < c.p_ignore + c.p_neg:
            if negs:
                t = negs[int(rng.integers(len(negs)))]
        elif u < c.p_ignore + c.p_neg + c.p_oob:
            if oobs:
                t = oobs[int(rng.integers(len(oobs)))]
        elif u < c.p_ignore + c.p_neg + c.p_oob + c.p_hit and V > 1:
            row = z64[i]
            # a maximum or a non-finite entry of the row
            fin = row[np.isfinite(row)]
            hit = ~np.isfinite(row)
            if fin.size:
                hit |= row == fin.max()
            special = np.nonzero(hit)[0]
            special = special[special <= hi]
            if special.size:
                t = int(rng.choice(special))
        out.append(t)
    return out


def make_targets(c: Case, values: list):
    lead = c.lead
    dt = np.dtype(c.tdtype)
    if c.tdtype == "uint64":
        arr = np.array(values, dtype=np.uint64) if values else np.zeros(0, np.uint64)
    else:
        arr = np.array(values, dtype=np.int64).astype(dt) if values else np.zeros(0, dt)
    arr = arr.reshape(lead)
    if c.tcontainer == "torch" and c.tdtype in TORCH_INT:
        return torch.from_numpy(arr.copy())
    if c.tcontainer == "strided" and lead:
        S = np.zeros(lead[:-1] + (lead[-1] * 2,), dt)
        S[..., ::2] = arr
        return S[..., ::2]
    if c.tcontainer == "bigendian":
        return arr.astype(dt.newbyteorder(">"))
    return arr


# ----------------------------------------------------------------------------
# The float64 reference


def capped64(a: np.ndarray, softcap) -> np.ndarray:
    """Stored values -> float64, softcapped in float64 (rows x V)."""
    z = np.asarray(a).astype(np.float64).reshape(-1, a.shape[-1])
    if softcap is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            z = softcap * np.tanh(z / softcap)
    return z


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def log_probs(z: np.ndarray) -> np.ndarray:
    """log softmax per row in float64 with the library's semantics for
    infinities: +inf entries share the mass equally, -inf have p = 0.
    Rows holding NaN or only -inf come out as NaN."""
    pinf = z == np.inf
    has_pinf = pinf.any(axis=1, keepdims=True)
    fin = np.where(np.isfinite(z), z, -np.inf)
    m = fin.max(axis=1, keepdims=True) if z.shape[1] else np.zeros((z.shape[0], 1))
    d = np.where(has_pinf, np.where(pinf, 0.0, -np.inf), z - m)
    d = np.where(np.isnan(z), np.nan, d)
    s = np.exp(d).sum(axis=1, keepdims=True)
    lp = d - np.log(s)
    bad = np.isnan(z).any(axis=1) | (z == -np.inf).all(axis=1)
    lp[bad] = np.nan
    return lp


@np.errstate(invalid="ignore")
def ref_entropy_rows(lp):
    p = np.exp(lp)
    return -np.where(p > 0, p * lp, 0.0).sum(axis=1)


@np.errstate(invalid="ignore", over="ignore")
def ref_kl_rows(lr, lz, r=None, z=None):
    """KL per row from log-probabilities, in float64: the entries whose
    reference probability is above 0 in float64 count (inf where the model
    rules such an entry out); r and z are accepted for the callers' sake."""
    p = np.exp(lr)
    return np.where(p > 0, p * (lr - lz), 0.0).sum(axis=1)


def bad_rows(z: np.ndarray) -> np.ndarray:
    """Rows that are an error when counted: NaN, or all -inf."""
    return np.isnan(z).any(axis=1) | (z == -np.inf).all(axis=1)


#: float64's per-row contract, absolute and relative (NLL, entropy, KL)
F64_TOL = 1e-13


def sum_rtol(c: Case) -> float:
    """relative tolerance of a sum or mean over rows, beside the rows' own"""
    return F64_TOL if c.dtype == "float64" else 1e-8


def tolerance(c: Case, ref: np.ndarray, z: np.ndarray, kl: bool = False) -> np.ndarray:
    """Per-row tolerance of the contract (see the module docstring). For KL
    the capped logits' rounding (float lanes) moves the reference's
    probabilities, each weighted by a log-probability difference of the
    order of the KL itself: that term scales with 1 + KL."""
    if c.dtype == "float64":
        atol, rtol, eps = F64_TOL, F64_TOL, 2.0**-52
    else:
        atol, rtol, eps = 2e-6, 1e-6, 2.0**-23
    tol = atol + rtol * np.abs(np.where(np.isfinite(ref), ref, 0.0))
    if c.softcap is not None and z.size:
        mag = np.abs(np.where(np.isfinite(z), z, 0.0)).max(axis=1)
        tol = tol + 4 * eps * mag * (1 + (np.abs(np.where(np.isfinite(ref), ref, 0.0)) if kl else 0))
    return tol


def fsum_or_inf(values):
    """math.fsum of non-negative values, inf where the sum overflows"""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def assert_rows_close(got, want, tol, what, c: Case):
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    want = np.asarray(want, dtype=np.float64).reshape(-1)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    inf_w = np.isinf(want)
    with np.errstate(invalid="ignore"):
        ok = np.where(inf_w, got == want, np.abs(got - want) <= tol)
        # a value at the edge of the output's range (float32 per-position
        # outputs for 16/32-bit logits) may come back as inf, and the other
        # way round
        edge = 1e300 if c.dtype == "float64" else 0.999 * float(np.finfo(np.float32).max)
        ok |= ((want > edge) & (got == np.inf)) | ((want == np.inf) & (got > edge))
    if not ok.all():
        i = int(np.argmin(ok))
        raise AssertionError(
            f"{what}: row {i} got {got[i]!r}, want {want[i]!r} (tol {float(np.broadcast_to(tol, want.shape)[i]):.3g}); "
            f"{int((~ok).sum())} of {ok.size} rows differ; case={c!r}")


def error_pattern(z_rows, oob=None, rz_rows=None):
    """A regex one of whose alternatives the ValueError must name: NaN, an
    all -inf row, an out-of-range target (for the rows that are counted)."""
    alts = []
    nan = np.isnan(z_rows).any() or (rz_rows is not None and np.isnan(rz_rows).any())
    if nan:
        alts.append("NaN")
    allneg = lambda a: a.size and (a == -np.inf).all(axis=1).any()
    if allneg(z_rows) or (rz_rows is not None and allneg(rz_rows)):
        alts.append("-inf")
    if oob is not None and np.any(oob):
        alts.append("range|target")
    assert alts
    return "|".join(alts)


def to_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class Setup:
    """Everything one case needs: the inputs as passed, and their reference."""

    def __init__(self, c: Case, with_ref: bool = False):
        self.c = c
        self.a = stored(c)
        self.logits = place(self.a, c.layout, c.container)
        self.z = capped64(self.a, c.softcap)
        self.tvals = logical_targets(c, self.a.astype(np.float64).reshape(-1, c.V))
        self.targets = make_targets(c, self.tvals)
        t = self.tvals
        self.counted = np.array([v >= 0 and v != c.ignore_index for v in t], dtype=bool)
        self.oob = np.array([cnt and v >= c.V for v, cnt in zip(t, self.counted)], dtype=bool)
        self.lp = log_probs(self.z)
        self.bad = bad_rows(self.z)
        if with_ref and c.ref != "none":
            self.ra = stored(c, "ref")
            self.ref_logits = place(self.ra, c.layout if c.ref != "independent" else "contig",
                                    c.container)
            self.rz = capped64(self.ra, c.softcap)
            self.rlp = log_probs(self.rz)
            self.rbad = bad_rows(self.rz)
        else:
            self.ref_logits = None

    def nll(self):
        out = np.zeros(self.c.n)
        for i in np.nonzero(self.counted & ~self.oob)[0]:
            out[i] = -self.lp[i, self.tvals[i]]
        return out

    def argmax_sets(self, z, a):
        """Per row: (certain index or -1, set of candidate indices). Without
        softcap the kernel compares the stored values exactly; with one, the
        capped values within a few lane ulps of the max are candidates."""
        c = self.c
        raw = a.astype(np.float64).reshape(-1, c.V)
        res = []
        eps = 2.0**-52 if c.dtype == "float64" else 2.0**-23
        for i in range(z.shape[0]):
            row = z[i]
            if np.isnan(row).any():
                res.append((-2, set()))
                continue
            mx = row.max()
            if c.softcap is None or mx == np.inf:
                cand = np.nonzero(row == mx)[0]
            else:
                cand = np.nonzero(row >= mx - 8 * eps * c.softcap)[0]
            vals = set(raw[i, cand].tolist())
            certain = int(cand[0]) if len(vals) == 1 else -1
            res.append((certain, set(cand.tolist())))
        return res


def with_isa(isa):
    class _Ctx:
        def __enter__(self):
            self.before = _core.active_isa()
            _core.set_isa(isa)

        def __exit__(self, *exc):
            _core.set_isa(self.before)
    return _Ctx()


# ----------------------------------------------------------------------------
# Strategies


@st.composite
def shapes(draw):
    k = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["small"] * 5 + ["edge"] * 4 + ["medium"] * 2 + ["big"]))
    if kind == "small":
        V = draw(st.integers(1, 70))
    elif kind == "edge":
        V = draw(st.sampled_from(EDGE_V))
    elif kind == "medium":
        V = draw(st.integers(70, 6000))
    else:
        V = draw(st.integers(6000, 300_000))
    max_rows = max(1, min(24, 600_000 // V))
    if kind == "big":
        max_rows = 2
    dims = [draw(st.integers(1, 4)) for _ in range(k)]
    while math.prod(dims) > max_rows:
        j = dims.index(max(dims))
        dims[j] = max(1, dims[j] // 2)
        if all(d == 1 for d in dims):
            break
    if draw(st.integers(0, 15)) == 0:
        dims[draw(st.integers(0, k - 1))] = 0
    return tuple(dims), V


def specials_strategy(max_n=6):
    return st.lists(
        st.tuples(st.sampled_from(SPECIAL_KINDS), st.integers(0, 63), st.integers(0, 10**6),
                  st.integers(1, 40), st.integers(0, len(TIE_VALUES) - 1)),
        max_size=max_n).map(tuple)


@st.composite
def cases(draw, ref=False, targets=True, allow_nan=True):
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    lead, V = draw(shapes())
    container = draw(st.sampled_from(["numpy", "numpy", "bigendian", "torch"]))
    if dtype == "bfloat16" and container == "bigendian":
        container = "numpy"
    layout = draw(st.sampled_from(LAYOUTS))
    base = draw(st.sampled_from(["normal"] * 4 + ["ramp", "const", "tiny", "wide"]))
    scale = draw(st.sampled_from([0.01, 1.0, 3.0, 10.0, 100.0, 1e4, 1e15, 1e30]))
    specials = draw(specials_strategy())
    if not allow_nan:
        specials = tuple(s for s in specials if s[0] != "nan")
    softcap = draw(st.one_of(st.none(), st.none(), st.sampled_from([0.5, 1.0, 15.0, 30.0, 50.0, 1e4, 1e30]),
                             st.floats(0.1, 1e6)))
    kw = {}
    if targets:
        kw = dict(
            ignore_index=draw(st.sampled_from([-100, -100, -1, -5, 0, 3, 70, 255, 2**40])),
            tdtype=draw(st.sampled_from(INT_DTYPES)),
            tcontainer=draw(st.sampled_from(["numpy", "numpy", "torch", "strided", "bigendian"])),
            p_ignore=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])),
            p_neg=draw(st.sampled_from([0.0, 0.2])),
            p_oob=draw(st.sampled_from([0.0] * 6 + [0.05, 0.3])),
            p_hit=draw(st.sampled_from([0.0, 0.3, 0.8])),
        )
    if ref:
        kw.update(ref=draw(st.sampled_from(["same", "perturbed", "perturbed", "independent"])),
                  ref_seed=draw(st.integers(0, 2**31)),
                  ref_specials=draw(specials_strategy(4)))
    return Case(dtype=dtype, lead=lead, V=V, layout=layout, container=container,
                seed=draw(st.integers(0, 2**31)), base=base, scale=scale, specials=specials,
                softcap=softcap, threads=draw(st.integers(1, 8)), isa=draw(st.sampled_from(ISAS)),
                **kw)


# ----------------------------------------------------------------------------
# Regression examples (one per known bug class)

M32 = float(np.finfo(np.float32).min)
M64 = float(np.finfo(np.float64).min)
BUG_EXAMPLES = [
    # a. softcap with V not a multiple of the vector step
    Case(dtype="float32", lead=(1,), V=1, values=((0.0,),), targets=(0,), softcap=1.0),
    Case(dtype="float32", lead=(2,), V=3, values=((0.0, 5.0, 1.0), (2.0, -1.0, 0.5)),
         targets=(1, 0), softcap=1.0),
    Case(dtype="bfloat16", lead=(3,), V=33, seed=5, softcap=30.0, scale=40.0),
    # b. KL with finite masks in both models
    Case(dtype="float32", lead=(2,), V=5, values=((1, 2, M32, M32, 3), (0, -1e30, 1, -1e30, 2)),
         targets=(0, 4), ref="same"),
    Case(dtype="float32", lead=(2,), V=67, seed=3, specials=(("mask-fmin", 0, 10, 40, 0), ("mask-fmin", 1, 0, 60, 0)),
         ref="perturbed", ref_specials=(("mask-fmin", 0, 10, 40, 0), ("mask-fmin", 1, 0, 60, 0))),
    # c. float64 row max >= 1e19
    Case(dtype="float64", lead=(1,), V=8, values=((1e19,) + (0.0,) * 7,), targets=(0,)),
    Case(dtype="float64", lead=(1,), V=8, values=((1e300,) + (0.0,) * 7,), targets=(0,)),
    # d. huge tied maxima in float32 / bfloat16
    Case(dtype="float32", lead=(1,), V=4, values=((1e15, 1e15, 1e15, 0.0),), targets=(0,)),
    Case(dtype="float32", lead=(1,), V=4, values=((1e17, 1e17, 1e17, 0.0),), targets=(0,)),
    Case(dtype="bfloat16", lead=(1,), V=3, values=((3e38, 3e38, 0.0),), targets=(0,)),
    # e. big-endian arrays
    Case(dtype="float32", lead=(2,), V=4, values=((1, 2, 3, 4), (0, 0, 5, 1)), targets=(0, 2),
         container="bigendian"),
    Case(dtype="float64", lead=(2, 3), V=37, seed=11, container="bigendian", layout="shifted"),
    Case(dtype="float16", lead=(3,), V=70, seed=12, container="bigendian", layout="negstride"),
    # f. uint64 targets >= 2^63
    Case(dtype="float32", lead=(2,), V=4, values=((0, 0, 0, 0), (1, 2, 3, 4)), targets=(0, 2**63),
         tdtype="uint64"),
    Case(dtype="float32", lead=(1,), V=4, values=((0, 0, 0, 0),), targets=(2**64 - 100,),
         tdtype="uint64"),
]
# found by this suite: float64 logits with a softcap that float32 cannot hold
# (the cap must be applied in float64: 2c, not 2 float32(c))
EXTRA_NLL_EXAMPLES = [
    Case(dtype="float64", lead=(1,), V=2, values=((1e9, -1e9),), targets=(1,), softcap=1e5 / 3),
    Case(dtype="float64", lead=(1,), V=512, layout="shifted", seed=1648, base="ramp", scale=1e15,
         softcap=499532.92921617575, ignore_index=70, tdtype="int32", tcontainer="strided",
         p_ignore=0.2, p_neg=0.2),
]
# found by this suite: the model rules out (-inf, or +inf elsewhere) an
# entry whose reference probability underflows: KL is what float64 gives
# (0 for an underflowed entry), not NaN / an error
EXTRA_KL_EXAMPLES = [
    Case(dtype="float64", lead=(1,), V=3, values=((M64, M64, 0.0),), ref="same"),
    Case(dtype="float64", lead=(1,), V=2, values=((-np.inf, 0.0),), ref_values=((0.0, 1e3),),
         ref="independent"),
    Case(dtype="float32", lead=(1,), V=2, values=((-np.inf, 0.0),), ref_values=((0.0, 1e6),),
         ref="independent"),
    Case(dtype="float32", lead=(1,), V=4, values=((0.0, 0.0, 0.0, np.inf),),
         ref_values=((1e4, 0.0, 0.0, 0.0),), ref="independent"),
]


def examples(*cs):
    def deco(f):
        for c in reversed(cs):
            f = example(c)(f)
        return f
    return deco


def check_threads_bitwise(f, c: Case, got):
    """The same call on one thread gives the same bits."""
    if c.threads == 1:
        return
    one = f(1)
    a, b = to_numpy(got), to_numpy(one)
    if isinstance(got, float):
        assert got == one or (math.isnan(got) and math.isnan(one)), (got, one, c)
    else:
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"threads {c.threads} vs 1 differ; case={c!r}"


# ----------------------------------------------------------------------------
# The properties


@examples(*BUG_EXAMPLES, *EXTRA_NLL_EXAMPLES)
@given(cases())
def test_nll_matches_float64(c):
    """token_nll and cross_entropy (sum, mean) against the float64 reference,
    or the documented ValueError; bitwise identical for any thread count;
    big-endian input gives the native numbers."""
    s = Setup(c)
    note(f"stored logits: {s.a!r}" if s.a.size <= 64 else f"stored shape {s.a.shape}")
    note(f"targets: {s.tvals[:32]!r}")
    counted_bad = s.counted & (s.bad | s.oob)
    kw = dict(ignore_index=c.ignore_index, softcap=c.softcap)
    with with_isa(c.isa):
        if counted_bad.any():
            pat = error_pattern(s.z[s.counted], s.oob)
            with pytest.raises(ValueError, match=pat):
                lmmetrics.token_nll(s.logits, s.targets, num_threads=c.threads, **kw)
            with pytest.raises(ValueError, match=pat):
                lmmetrics.cross_entropy(s.logits, s.targets, reduction="sum", num_threads=c.threads, **kw)
            return
        got = lmmetrics.token_nll(s.logits, s.targets, num_threads=c.threads, **kw)
        total = lmmetrics.cross_entropy(s.logits, s.targets, reduction="sum", num_threads=c.threads, **kw)
        mean = lmmetrics.cross_entropy(s.logits, s.targets, num_threads=c.threads, **kw)
        check_threads_bitwise(lambda k: lmmetrics.token_nll(s.logits, s.targets, num_threads=k, **kw), c, got)
        check_threads_bitwise(lambda k: lmmetrics.cross_entropy(s.logits, s.targets, reduction="sum",
                                                                num_threads=k, **kw), c, total)
        if c.container == "bigendian":
            native = place(s.a, c.layout, "numpy")
            same = lmmetrics.token_nll(native, s.targets, num_threads=c.threads, **kw)
            assert np.array_equal(to_numpy(got), to_numpy(same)), "big-endian differs from native"
    g = to_numpy(got)
    assert g.shape == c.lead
    assert g.dtype == (np.float64 if c.dtype == "float64" else np.float32)
    if c.container == "torch":
        assert isinstance(got, torch.Tensor)
    want = s.nll()
    tol = tolerance(c, want, s.z)
    assert_rows_close(g, want, tol, "token_nll", c)
    assert (g.reshape(-1)[~s.counted] == 0).all(), "ignored rows must be 0"
    n = int(s.counted.sum())
    if (np.isinf(want) & s.counted).any():
        assert total == math.inf
        return
    wsum = fsum_or_inf(want[s.counted].tolist())
    stol = sum_rtol(c) * abs(wsum) + float(tol[s.counted].sum())
    assert total == wsum or abs(total - wsum) <= stol, ("sum", total, wsum, c)
    if n == 0:
        assert math.isnan(mean) and total == 0.0
    else:
        assert mean == wsum / n or abs(mean - wsum / n) <= stol / n, ("mean", mean, wsum / n, c)


@examples(*[c for c in BUG_EXAMPLES if c.softcap is not None or c.container == "bigendian"],
          # found by this suite: float64 masks at finfo(float64).min are no NaN
          Case(dtype="float64", lead=(1,), V=3, values=((M64, M64, 0.0),)),
          Case(dtype="float32", lead=(1,), V=3, values=((-np.inf, np.inf, np.inf),)),
          Case(dtype="float16", lead=(1,), V=5, values=((-np.inf,) * 5,), softcap=2.0))
@given(cases(targets=False))
def test_entropy_matches_float64(c):
    """token_entropy against -sum p log p in float64: every row counted, so
    NaN anywhere (or an all -inf row without softcap) is a ValueError."""
    s = Setup(c)
    note(f"stored logits: {s.a!r}" if s.a.size <= 64 else f"stored shape {s.a.shape}")
    with with_isa(c.isa):
        if s.bad.any():
            with pytest.raises(ValueError, match=error_pattern(s.z)):
                lmmetrics.token_entropy(s.logits, softcap=c.softcap, num_threads=c.threads)
            return
        got = lmmetrics.token_entropy(s.logits, softcap=c.softcap, num_threads=c.threads)
        check_threads_bitwise(lambda k: lmmetrics.token_entropy(s.logits, softcap=c.softcap, num_threads=k),
                              c, got)
        if c.container == "bigendian":
            same = lmmetrics.token_entropy(place(s.a, c.layout, "numpy"), softcap=c.softcap,
                                           num_threads=c.threads)
            assert np.array_equal(to_numpy(got), to_numpy(same)), "big-endian differs from native"
    g = to_numpy(got)
    assert g.shape == c.lead
    want = ref_entropy_rows(s.lp)
    assert_rows_close(g, want, tolerance(c, want, s.z), "token_entropy", c)


def _kl_expected(s: Setup, rows=None):
    want = ref_kl_rows(s.rlp, s.lp, s.rz, s.z)
    return want if rows is None else want[rows]


@examples(*[c for c in BUG_EXAMPLES if c.ref != "none"], *EXTRA_KL_EXAMPLES,
          Case(dtype="float64", lead=(2,), V=6, values=((1, 2, -1e300, 3, 0, 0), (5, 5, 5, 5, 5, 5)), ref="same"),
          Case(dtype="float32", lead=(1,), V=4, values=((0, np.inf, 1, np.inf),), ref="same"),
          Case(dtype="float32", lead=(1,), V=40, seed=2, specials=(("-inf", 0, 3, 1, 0),), ref="perturbed"),
          # the exact path's KL of 14070 terms of 1.8e308 (a model logit at float64's max): summed
          # naively it came out 3.8e-13 off (the contract is 1e-13); compensated now
          Case(dtype="float64", lead=(1,), V=14071, base="const", scale=0.01,
               specials=(("-inf", 0, 0, 1, 0), ("max", 0, 0, 1, 0)), isa="scalar", ref="independent"),
          Case(dtype="float16", lead=(3, 2), V=129, seed=4, ref="same",
               specials=(("mask-fmin", 1, 0, 100, 0), ("fmin", 4, 128, 1, 0))))
@given(cases(ref=True, targets=False))
@np.errstate(over="ignore")  # the references' sums of values near the float64 range are inf, as expected
def test_kl_matches_float64(c):
    """token_kl / kl_divergence(reference, logits) against float64;
    KL(P || P) = 0 even with finite masks; inf where the model rules out an
    entry the reference gives mass."""
    c = Case(**{**c.__dict__, "softcap": None})  # token_kl takes no softcap
    s = Setup(c, with_ref=True)
    note(f"stored logits: {s.a!r}\nreference: {s.ra!r}" if s.a.size <= 64 else f"shape {s.a.shape}")
    with with_isa(c.isa):
        if (s.bad | s.rbad).any():
            pat = error_pattern(s.z, None, s.rz)
            with pytest.raises(ValueError, match=pat):
                lmmetrics.token_kl(s.logits, reference_logits=s.ref_logits, num_threads=c.threads)
            with pytest.raises(ValueError, match=pat):
                lmmetrics.kl_divergence(s.logits, reference_logits=s.ref_logits, num_threads=c.threads)
            return
        got = lmmetrics.token_kl(s.logits, reference_logits=s.ref_logits, num_threads=c.threads)
        total = lmmetrics.kl_divergence(s.logits, reference_logits=s.ref_logits, reduction="sum", num_threads=c.threads)
        mean = lmmetrics.kl_divergence(s.logits, reference_logits=s.ref_logits, num_threads=c.threads)
        check_threads_bitwise(lambda k: lmmetrics.token_kl(s.logits, reference_logits=s.ref_logits, num_threads=k), c, got)
    g = to_numpy(got).astype(np.float64).reshape(-1)
    assert to_numpy(got).shape == c.lead
    want = _kl_expected(s)
    tol = tolerance(c, want, np.concatenate([s.z, s.rz], axis=1), kl=True)
    if c.ref == "same":
        want = np.where(np.isnan(want), 0.0, want)  # identical rows: exactly 0 in exact arithmetic
        want[:] = 0.0
    assert_rows_close(g, want, tol, "token_kl", c)
    assert (g >= -tol).all(), "KL below 0"
    if np.isinf(want).any():
        if np.isinf(g).any():
            assert total == math.inf and mean == math.inf
        else:  # rows at the edge of the range, finite here and inf in the reference (a
            # model with all its mass on a logit of 1.8e308: KL = 1.8e308 - 5.2, which
            # the reference's sum of p (lr - lz), its p adding to 1 + 1e-16, overflowed)
            assert total > 1e300 and mean > 1e300 / max(c.n, 1), ("kl at the edge", total, mean, c)
        return
    wsum = fsum_or_inf(want.tolist())
    stol = sum_rtol(c) * abs(wsum) + float(tol.sum())
    assert total == wsum or abs(total - wsum) <= stol or min(total, wsum) > 1e300, ("kl sum", total, wsum, c)
    if c.n:
        assert mean == wsum / c.n or abs(mean - wsum / c.n) <= stol / c.n or min(mean, wsum / c.n) > 1e300 / c.n, ("kl mean", mean, wsum / c.n, c)
    else:
        assert math.isnan(mean)


@examples(*BUG_EXAMPLES,
          Case(dtype="float32", lead=(1,), V=5, values=((1, 7, 7, 3, 7),), targets=(1,)),
          Case(dtype="float32", lead=(1,), V=5, values=((1, 7, 7, 3, 7),), targets=(2,)),
          Case(dtype="float64", lead=(2,), V=3, values=((0, 5e-324, 0), (-np.inf, 1, np.nan)),
               targets=(1, -100)),
          Case(dtype="bfloat16", lead=(2,), V=40, seed=9, specials=(("tie", 0, 1, 5, 0), ("tie", 1, 39, 3, 4)),
               p_hit=1.0, ref="perturbed"),
          # found by this suite: a loss past 709.78 nats must give perplexity inf, not OverflowError
          Case(dtype="float16", lead=(1, 4, 2), V=27, layout="shifted", seed=58146, scale=1e4, threads=6,
               ignore_index=70, tdtype="int16", p_ignore=0.2, ref="same"),
          *EXTRA_NLL_EXAMPLES[:1], *[dataclasses.replace(c, targets=(0,)) for c in EXTRA_KL_EXAMPLES])
@given(cases(ref=True))
@np.errstate(over="ignore")  # the references' means of values near the float64 range are inf, as expected
def test_evaluate_matches_float64(c):
    """evaluate(): tokens, ignored, loss, accuracy (lowest index on ties),
    entropy over counted rows, and with reference_logits the mean KL and
    same_top; ignored rows are not read (NaN / all -inf there is fine)."""
    s = Setup(c, with_ref=True)
    note(f"stored logits: {s.a!r}" if s.a.size <= 64 else f"stored shape {s.a.shape}")
    note(f"targets: {s.tvals[:32]!r}")
    kw = dict(ignore_index=c.ignore_index, softcap=c.softcap)
    has_ref = s.ref_logits is not None
    if has_ref:
        kw["reference_logits"] = s.ref_logits
    bad = s.bad | (s.rbad if has_ref else False)
    with with_isa(c.isa):
        if (s.counted & (bad | s.oob)).any():
            pat = error_pattern(s.z[s.counted], s.oob, s.rz[s.counted] if has_ref else None)
            with pytest.raises(ValueError, match=pat):
                lmmetrics.evaluate(s.logits, s.targets, num_threads=c.threads, **kw)
            return
        m = lmmetrics.evaluate(s.logits, s.targets, num_threads=c.threads, **kw)
        if c.threads != 1:
            m1 = lmmetrics.evaluate(s.logits, s.targets, num_threads=1, **kw)
            assert repr(m.as_dict()) == repr(m1.as_dict()), "evaluate depends on num_threads"
    cnt = s.counted
    n = int(cnt.sum())
    assert m.tokens == n and m.ignored == c.n - n
    nll = s.nll()
    tol = tolerance(c, nll, s.z)
    if n == 0:
        assert math.isnan(m.loss) and math.isnan(m.accuracy) and math.isnan(m.entropy)
        return
    if np.isinf(nll[cnt]).any():
        assert m.loss == math.inf and m.perplexity == math.inf
    else:
        wsum = fsum_or_inf(nll[cnt].tolist())
        assert m.nll_sum == wsum or abs(m.nll_sum - wsum) <= sum_rtol(c) * abs(wsum) + tol[cnt].sum(), \
            ("nll_sum", m.nll_sum, wsum)
        assert m.loss == m.nll_sum / n
        # exp(loss), inf past the float64 range (not an OverflowError)
        with np.errstate(over="ignore"):  # past 709.78, inf is the expected value
            assert m.perplexity == (math.exp(m.loss) if m.loss < 709 else np.exp(m.loss))
        assert m.bits_per_token == m.loss / math.log(2)
    ent = ref_entropy_rows(s.lp)[cnt]
    etol = tolerance(c, ent, s.z[cnt])
    assert abs(m.entropy - ent.mean()) <= etol.mean(), ("entropy", m.entropy, ent.mean(), c)
    # accuracy: certain rows exact, rows whose top is within rounding of the softcap either way
    am = s.argmax_sets(s.z, s.a)
    t = s.tvals
    lo = sum(1 for i in np.nonzero(cnt)[0] if am[i][0] == t[i])
    amb = sum(1 for i in np.nonzero(cnt)[0] if am[i][0] == -1 and t[i] in am[i][1])
    assert lo / n - 1e-12 <= m.accuracy <= (lo + amb) / n + 1e-12, ("accuracy", m.accuracy, lo, amb, n, c)
    if has_ref:
        kl = _kl_expected(s, cnt)
        ktol = tolerance(c, kl, np.concatenate([s.z, s.rz], axis=1)[cnt], kl=True)
        if c.ref == "same":
            kl = np.zeros_like(kl)
        if np.isinf(kl).any():  # or a row at the edge of the range, finite here (test_kl_matches_float64)
            assert m.kl == math.inf or m.kl > 1e300 / n, ("kl", m.kl, kl, c)
        elif np.isinf(kl.mean()) or kl.mean() > 1e300:  # finite rows whose sum passes the float64 range, or
            # a row at its edge (a logit of 1.8e308, past the 1e300 the contract covers: KL 1.797e308 here)
            assert m.kl > 1e300, ("kl at the edge", m.kl, kl, c)
        else:
            assert abs(m.kl - kl.mean()) <= ktol.mean(), ("kl", m.kl, kl.mean(), c)
        ram = s.argmax_sets(s.rz, s.ra)
        same_lo = same_hi = 0
        for i in np.nonzero(cnt)[0]:
            a_c, a_s = am[i]
            r_c, r_s = ram[i]
            if a_c >= 0 and r_c >= 0:
                same_lo += a_c == r_c
                same_hi += a_c == r_c
            else:
                same_hi += bool((a_s if a_c < 0 else {a_c}) & (r_s if r_c < 0 else {r_c}))
        assert same_lo / n - 1e-12 <= m.same_top <= same_hi / n + 1e-12, ("same_top", m.same_top, c)


# ----------------------------------------------------------------------------
# Documented exceptions


@given(st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint64", "bool"]),
       st.sampled_from(["numpy", "torch"]))
def test_integer_logits_are_type_error(dt, container):
    z = np.zeros((2, 5), dtype=dt)
    if container == "torch":
        z = torch.from_numpy(z)
    with pytest.raises(TypeError):
        lmmetrics.token_nll(z, np.array([0, 1]))
    with pytest.raises(TypeError):
        lmmetrics.token_entropy(z)


@given(st.sampled_from(["float16", "float32", "float64"]), st.sampled_from(["numpy", "torch"]),
       st.sampled_from(DTYPE_NAMES))
def test_float_targets_are_type_error(tdt, container, dtype):
    z = np.zeros((2, 5), dtype=NP_DT[dtype])
    t = np.array([0.0, 1.0], dtype=tdt)
    if container == "torch":
        t = torch.from_numpy(t)
    with pytest.raises(TypeError):
        lmmetrics.token_nll(z, t)
    with pytest.raises(TypeError):
        lmmetrics.evaluate(z, t)


@given(shapes(), st.integers(1, 3))
def test_shape_mismatch_is_value_error(shape, extra):
    lead, V = shape
    V = min(V, 50)
    z = np.zeros(lead + (V,), np.float32)
    bad = lead[:-1] + (lead[-1] + extra,)
    with pytest.raises(ValueError):
        lmmetrics.token_nll(z, np.zeros(bad, np.int64))
    with pytest.raises(ValueError):
        lmmetrics.token_kl(z, reference_logits=np.zeros(lead[:-1] + (lead[-1] + extra, V), np.float32))


@pytest.mark.parametrize("cap", [3.4e38, 3.5e38, 1e39, 1e300, float("inf"), float("nan"), 0.0, -1.0])
def test_bad_softcap_is_value_error(cap):
    z = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match="softcap"):
        lmmetrics.token_nll(z, np.array([0, 1]), softcap=cap)
    with pytest.raises(ValueError, match="softcap"):
        lmmetrics.evaluate(z, np.array([0, 1]), softcap=cap)


@pytest.mark.parametrize("cap", ["30", b"30", [30.0], (30.0,)])
def test_softcap_of_wrong_type_is_rejected(cap):
    z = np.zeros((2, 5), np.float32)
    with pytest.raises((TypeError, ValueError)):
        lmmetrics.token_nll(z, np.array([0, 1]), softcap=cap)
    with pytest.raises((TypeError, ValueError)):
        lmmetrics.token_entropy(z, softcap=cap)


@pytest.mark.parametrize("t", [2**63, 2**63 + 5, 2**64 - 1, 2**64 - 100])
def test_uint64_targets_beyond_int64_are_value_error(t):
    z = np.zeros((2, 4), np.float32)
    tg = np.array([0, t], np.uint64)
    with pytest.raises(ValueError):
        lmmetrics.token_nll(z, tg)
    with pytest.raises(ValueError):
        lmmetrics.evaluate(z, tg)
    with pytest.raises(ValueError):
        lmmetrics.cross_entropy(z, tg, reduction="sum")


# ----------------------------------------------------------------------------
# The known bug classes, spelled out on every SIMD path


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("V", [1, 2, 3, 17, 33, 65])
def test_softcap_with_ragged_vocabulary(isa, dtype, V):
    """a: c * tanh(z / c) of every logit, whatever V modulo the vector step."""
    rng = np.random.default_rng(V)
    z = (rng.standard_normal((3, V)) * 4).astype(NP_DT[dtype])
    t = np.array([0, V - 1, V // 2])
    for cap in (1.0, 30.0):
        zc = capped64(z, cap)
        lp = log_probs(zc)
        want = -lp[np.arange(3), t]
        tol = 2e-6 + 1e-6 * np.abs(want) + 4 * 2.0**-23 * cap
        got = lmmetrics.token_nll(z, t, softcap=cap).astype(np.float64)
        np.testing.assert_array_less(np.abs(got - want), tol)
        ent = lmmetrics.token_entropy(z, softcap=cap).astype(np.float64)
        np.testing.assert_array_less(np.abs(ent - ref_entropy_rows(lp)), tol * 3)
    one = np.zeros((1, 1), NP_DT[dtype])
    assert lmmetrics.token_nll(one, np.array([0]), softcap=1.0)[0] == 0.0
    assert abs(lmmetrics.token_entropy(one, softcap=1.0)[0]) <= 2e-6


@pytest.mark.parametrize("dtype", [d for d in DTYPE_NAMES if d != "float64"])
def test_softcap_allowance(isa, dtype):
    """The README's softcap allowance: for float32 and 16-bit input the
    capped logits are rounded to float32, so the per-token NLL and entropy
    may differ from float64 by 5e-7 * c beyond the 2e-6 + 1e-6 |value| of
    uncapped logits (Gemma-style caps of 30-100 on logits of a few tens
    measure up to 1e-7 * c)."""
    rng = np.random.default_rng(7)
    V = 257
    for cap in (30.0, 50.0, 100.0):
        for scale in (10.0, 30.0, 60.0):
            z = (rng.standard_normal((2000, V)) * scale).astype(NP_DT[dtype])
            t = rng.integers(0, V, z.shape[0])
            lp = log_probs(capped64(z, cap))
            want = -lp[np.arange(z.shape[0]), t]
            got = lmmetrics.token_nll(z, t, softcap=cap).astype(np.float64)
            np.testing.assert_array_less(np.abs(got - want), 2e-6 + 1e-6 * np.abs(want) + 5e-7 * cap)
            ent_want = ref_entropy_rows(lp)
            ent = lmmetrics.token_entropy(z, softcap=cap).astype(np.float64)
            np.testing.assert_array_less(np.abs(ent - ent_want), 2e-6 + 1e-6 * np.abs(ent_want) + 5e-7 * cap)


@pytest.mark.parametrize("dtype,mask", [("float32", M32), ("float32", -1e30), ("float64", M32),
                                        ("float64", -1e30), ("float64", float(np.finfo(np.float64).min)),
                                        ("bfloat16", "min"), ("bfloat16", -1e30), ("float16", "min")])
@pytest.mark.parametrize("V", [5, 40, 1000])
def test_kl_with_finite_masks(isa, dtype, mask, V):
    """b: finite masks in both models; KL(z || z) = 0."""
    if mask == "min":
        mask = float(_finfo(dtype).min)
    rng = np.random.default_rng(V)
    z = rng.standard_normal((4, V)) * 3
    z[:, 1::3] = mask
    z[2, :-1] = mask
    z = z.astype(NP_DT[dtype])
    mask = float(np.array(mask).astype(NP_DT[dtype]).astype(np.float64))  # as stored
    r = (z.astype(np.float64) + np.where(z.astype(np.float64) == mask, 0.0,
                                         rng.standard_normal(z.shape) * 0.2)).astype(NP_DT[dtype])
    tol = F64_TOL if dtype == "float64" else 2e-6
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=z), 0.0, atol=tol)
    assert abs(lmmetrics.kl_divergence(z, reference_logits=z)) <= tol
    want = ref_kl_rows(log_probs(r.astype(np.float64)), log_probs(z.astype(np.float64)))
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r), want, atol=tol, rtol=1e-6)
    assert abs(lmmetrics.kl_divergence(z, reference_logits=r) - want.mean()) <= tol


@pytest.mark.parametrize("top", [1e15, 1e17, 1e19, 1e30, 1e300, 1.7e308])
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_float64_huge_maxima(isa, top, k):
    """c / d: a row max of 1e19 or more in float64, k tied."""
    for V in (k + 1, 8, 40):
        z = np.zeros((1, V))
        z[0, :k] = top
        got = lmmetrics.token_nll(z, np.array([0]))[0]
        assert abs(got - math.log(k)) <= F64_TOL, (top, k, V, got)
        assert abs(lmmetrics.token_entropy(z)[0] - math.log(k)) <= F64_TOL
        assert lmmetrics.token_nll(z, np.array([V - 1]))[0] == pytest.approx(top, rel=1e-12)


@pytest.mark.parametrize("dtype,top", [("float32", 1e15), ("float32", 1e17), ("float32", 3e38),
                                       ("float32", float(np.finfo(np.float32).max)),
                                       ("bfloat16", 3e38), ("bfloat16", 1e30), ("float16", 6e4),
                                       ("float16", 65504.0)])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_low_precision_huge_maxima(isa, dtype, top, k):
    """d: tied huge maxima in 16/32-bit storage."""
    for V in (k + 1, k + 2, 33):
        z = np.zeros((1, V))
        z[0, :k] = top
        z = z.astype(NP_DT[dtype])
        got = float(lmmetrics.token_nll(z, np.array([0]))[0])
        assert abs(got - math.log(k)) <= 2e-6, (dtype, top, k, V, got)
        assert abs(float(lmmetrics.token_entropy(z)[0]) - math.log(k)) <= 2e-6
        m = lmmetrics.evaluate(z, np.array([0]))
        assert m.accuracy == 1.0


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("layout", ["contig", "shifted", "negstride", "transposed", "vocab_step", "fortran"])
def test_big_endian_same_as_native(isa, dtype, layout):
    """e: '>f4', '>f8', '>f2' read as their values."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 4, 37)) * 3).astype(dtype)
    t = rng.integers(0, 37, (3, 4))
    r = (a + rng.standard_normal(a.shape).astype(dtype)).astype(dtype)
    nat, be = place(a, layout, "numpy"), place(a, layout, "bigendian")
    rnat, rbe = place(r, layout, "numpy"), place(r, layout, "bigendian")
    want = -log_probs(a.astype(np.float64).reshape(-1, 37))[np.arange(12), t.reshape(-1)]
    tol = F64_TOL if dtype == "float64" else 2e-6
    np.testing.assert_allclose(lmmetrics.token_nll(be, t).reshape(-1), want, atol=tol, rtol=1e-6)
    assert np.array_equal(lmmetrics.token_nll(be, t), lmmetrics.token_nll(nat, t))
    assert np.array_equal(lmmetrics.token_entropy(be), lmmetrics.token_entropy(nat))
    assert np.array_equal(lmmetrics.token_kl(be, reference_logits=rbe), lmmetrics.token_kl(nat, reference_logits=rnat))
    assert np.array_equal(lmmetrics.token_kl(nat, reference_logits=rbe), lmmetrics.token_kl(nat, reference_logits=rnat))
    assert lmmetrics.evaluate(be, t).as_dict() == lmmetrics.evaluate(nat, t).as_dict()
    assert np.array_equal(lmmetrics.token_nll(nat, t.astype(">i8")), lmmetrics.token_nll(nat, t))


# ----------------------------------------------------------------------------
# Semantics spelled out


def test_infinities_semantics(isa):
    z = np.array([[0.0, np.inf, 1.0, np.inf, -np.inf, np.inf],
                  [0.0, np.inf, 1.0, np.inf, -np.inf, np.inf],
                  [0.0, np.inf, 1.0, np.inf, -np.inf, np.inf],
                  [0.0, 1.0, 2.0, -np.inf, -np.inf, 3.0]], np.float32)
    t = np.array([1, 0, 4, 3])
    got = lmmetrics.token_nll(z, t)
    assert abs(got[0] - math.log(3)) <= 2e-6
    assert got[1] == np.inf and got[2] == np.inf and got[3] == np.inf
    ent = lmmetrics.token_entropy(z)
    assert abs(ent[0] - math.log(3)) <= 2e-6
    m = lmmetrics.evaluate(z, np.array([3, -1, -100, 5]))
    assert m.accuracy == 0.5 and m.tokens == 2  # argmax row 0 is index 1, the first +inf


def test_ignored_rows_are_not_read(isa):
    z = np.array([[np.nan] * 5, [-np.inf] * 5, [1, 2, 3, 4, 5], [np.nan, 0, 0, 0, 0]], np.float32)
    for ignore in (-100, 7, 0):
        t = np.array([-1, ignore if ignore != 0 else -3, 4, ignore])
        got = lmmetrics.token_nll(z, t, ignore_index=ignore)
        assert got[0] == 0 and got[1] == 0 and got[3] == 0
        m = lmmetrics.evaluate(z, t, ignore_index=ignore, reference_logits=z)
        assert m.tokens == 1 and m.accuracy == 1.0
    with pytest.raises(ValueError, match="NaN"):
        lmmetrics.token_nll(z, np.array([0, -1, 4, -1]))
    with pytest.raises(ValueError, match="-inf"):
        lmmetrics.token_nll(z, np.array([-1, 0, 4, -1]))
    with pytest.raises(ValueError, match="range"):
        lmmetrics.token_nll(z, np.array([-1, -1, 5, -1]))


def test_softcap_maps_neg_inf_to_minus_cap(isa):
    z = np.array([[-np.inf, 0.0, 2.0], [-np.inf] * 3], np.float32)
    for cap in (1.0, 30.0):
        want = -log_probs(capped64(z, cap))[[0, 1], [0, 2]]
        got = lmmetrics.token_nll(z, np.array([0, 2]), softcap=cap)
        np.testing.assert_allclose(got, want, atol=2e-6 + 8 * 2.0**-23 * cap)
        assert abs(got[1] - math.log(3)) <= 2e-6


# ----------------------------------------------------------------------------
# Mismatches this suite found beyond the known list (minimal reproducers)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kl_where_model_rules_out_underflowed_mass(isa, dtype):
    """The model rules out an entry whose reference probability underflows
    float64 (e^-1000, e^-1e6): KL is float64's answer, 0 for that entry;
    where the reference's probability is representable it is inf. Never NaN,
    never a 'NaN in reference_logits' error."""
    for r, z, want in ([[0.0, 1e3], [-np.inf, 0.0], 0.0], [[0.0, 1e6], [-np.inf, 0.0], 0.0],
                       [[1e4, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, np.inf], np.inf],
                       [[0.0, 30.0], [-np.inf, 0.0], np.inf]):
        r, z = np.array([r], dtype), np.array([z], dtype)
        assert lmmetrics.token_kl(z, reference_logits=r)[0] == pytest.approx(want, abs=1e-6), (r, z)
        assert lmmetrics.kl_divergence(z, reference_logits=r) == pytest.approx(want, abs=1e-6)
        assert lmmetrics.evaluate(z, np.array([1]), reference_logits=r).kl == pytest.approx(want, abs=1e-6)


def test_perplexity_past_float64_range_is_inf():
    """exp(loss) for a loss above 709.78 nats is inf, not OverflowError."""
    z = np.array([[0.0, -1000.0]])
    t = np.array([1])
    assert lmmetrics.cross_entropy(z, t) == pytest.approx(1000.0)
    assert lmmetrics.perplexity(z, t) == math.inf
    assert lmmetrics.evaluate(z, t).perplexity == math.inf
    ev = lmmetrics.Evaluator()
    ev.update(z, t)
    assert ev.compute().perplexity == math.inf


def test_float64_softcap_applied_in_float64(isa):
    """A softcap float32 cannot hold is not rounded for float64 logits:
    [1e9, -1e9] capped at c is [c, -c], NLL of the second is 2c."""
    c = 1e5 / 3
    got = lmmetrics.token_nll(np.array([[1e9, -1e9]]), np.array([1]), softcap=c)[0]
    assert abs(got - 2 * c) <= 1e-9 + 1e-12 * 2 * c, (got, 2 * c)


@pytest.mark.parametrize("V", [3, 129, 1000])
def test_float64_masks_at_finfo_min_are_not_nan(isa, V):
    """Masks at finfo(float64).min (a common finite mask) are numbers: no
    'NaN in logits' from token_entropy or token_kl; entropy 0 and KL(z||z) 0
    for a row with one unmasked entry."""
    z = np.full((2, V), M64)
    z[0, -1] = 0.0
    z[1, ::2] = 1.5
    want = ref_entropy_rows(log_probs(z))
    assert abs(lmmetrics.token_entropy(z)[0]) <= F64_TOL
    np.testing.assert_allclose(lmmetrics.token_entropy(z), want, atol=F64_TOL)
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=z), 0.0, atol=F64_TOL)
    np.testing.assert_allclose(lmmetrics.token_nll(z, np.array([V - 1, 0])),
                               -log_probs(z)[[0, 1], [V - 1, 0]], atol=F64_TOL)
