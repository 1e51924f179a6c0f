"""The Triton kernel (lmmetrics._engine.cuda.triton) without a GPU.

Each group runs in a fresh process with TRITON_INTERPRET=1 set before
triton is imported (the variable is read when the kernels are decorated),
on CPU tensors routed through the CUDA path with the Triton kernel forced
and a small tile, so that short rows span several tiles. Every result is
checked against the native core on the same values (numpy) and against a
float64 reference. A compile-only test builds the kernels for sm_90 and
checks that they do not spill registers.
"""
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

pytest.importorskip("torch")
pytest.importorskip("triton")

import lmmetrics  # noqa: E402
from helpers import BF16, Jobs, inf_and_nan_head, ref_entropy, ref_kl, ref_nll  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(lmmetrics.__file__)))
TOL = 2e-6
KEYS = ("nll", "entropy", "argmax", "kl", "ref_argmax", "ref_nll")


def _child(group, interpret=True, timeout=300):
    """The group run in a fresh process (TRITON_INTERPRET=1 set before
    triton is imported, with interpret); its CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, HERE, os.path.dirname(HERE),
                                                        os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", f"import test_triton as m; m.{group}()"], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _passed(proc):
    """A group's process passed (printed GROUP OK), or skipped itself."""
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 and "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIP:", 1)[1].strip())
    assert proc.returncode == 0, out[-6000:]
    assert "GROUP OK" in proc.stdout, out[-6000:]


# ------------------------------------------------------------ in the child

def _route(tile=256):
    """CPU tensors take the CUDA path, there the Triton kernel (interpreted);
    returns the list that records each call of the kernel's launcher."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    from lmmetrics._engine import cuda as _cuda, inputs as _inputs
    from lmmetrics import _engine
    from lmmetrics._engine.cuda import triton as _triton

    assert _triton.INTERPRET
    routed = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    _inputs.is_cuda = routed
    _cuda._force_triton = True
    _triton._span = tile
    calls = []
    launch = _triton.compute
    _triton.compute = lambda *a: calls.append(1) or launch(*a)
    return calls


def _np(x):
    """A tensor's values as numpy in the same dtype (bfloat16 via ml_dtypes)."""
    import torch

    if x is None:
        return None
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(BF16)
    return x.numpy()


def _both(z, t=None, r=None, softcap=None, ignore_index=-100, **want):
    """(Triton, native core) RowResults for the same values."""
    from lmmetrics import _engine

    want = want or dict(nll=t is not None, entropy=True, argmax=True, kl=r is not None,
                        ref_nll=r is not None and t is not None)
    kw = dict(ignore_index=ignore_index, softcap=softcap, **want)
    got = _engine.run(z, t, r, **kw)
    exp = _engine.run(_np(z), _np(t), _np(r), **kw)
    return got, exp


def _capped(x, softcap):
    x = np.asarray(x, np.float64)
    return x if softcap is None else softcap * np.tanh(x / softcap)


def _check(z, t=None, r=None, softcap=None, ignore_index=-100, label="", **want):
    """The Triton path against the native core and a float64 reference."""
    got, exp = _both(z, t, r, softcap, ignore_index, **want)
    zf = _capped(_np(z).astype(np.float64), softcap).reshape(-1, z.shape[-1])
    rf = None if r is None else _capped(_np(r).astype(np.float64), softcap).reshape(-1, z.shape[-1])
    counted = got.counted
    for k in KEYS:
        a, b = getattr(got, k), getattr(exp, k)
        assert (a is None) == (b is None), (label, k)
        if a is None:
            continue
        if "argmax" in k:
            np.testing.assert_array_equal(a, b, err_msg=f"{label} {k}")
        else:
            np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=f"{label} {k} inf")
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=f"{label} {k} vs core")
    # float64 references on the counted rows whose values are finite
    fin = counted & np.isfinite(zf).all(1) & (True if rf is None else np.isfinite(rf).all(1))
    if fin.any():
        if got.nll is not None:
            tt = got.targets[fin]
            want_nll = ref_nll(zf[fin], tt)
            np.testing.assert_allclose(got.nll[fin], want_nll, rtol=TOL, atol=TOL, err_msg=label)
        if got.entropy is not None:
            np.testing.assert_allclose(got.entropy[fin], ref_entropy(zf[fin]), rtol=TOL, atol=TOL, err_msg=label)
        if got.argmax is not None:
            np.testing.assert_array_equal(got.argmax[fin], np.argmax(zf[fin], 1), err_msg=label)
        if got.kl is not None:
            np.testing.assert_allclose(got.kl[fin], ref_kl(rf[fin], zf[fin]), rtol=TOL, atol=TOL, err_msg=label)
        if got.ref_nll is not None:
            np.testing.assert_allclose(got.ref_nll[fin], ref_nll(rf[fin], got.targets[fin]), rtol=TOL,
                                       atol=TOL, err_msg=label)
    return got


def _dtypes():
    import torch

    return [torch.float32, torch.bfloat16, torch.float16]


def _random(shape, V, dtype, seed, scale=3.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, V, generator=g, dtype=torch.float64) * scale
    r = z + torch.randn(*shape, V, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::4] = -100
    return z.to(dtype), r.to(dtype), t


def _special(V, dtype):
    """The edge-case matrix: masks, a leading all -inf tile, a lone finite
    entry, +inf (once, twice), NaN and all -inf in ignored rows, ties, a
    target at -inf, large offsets."""
    import torch

    g = torch.Generator().manual_seed(7)
    z = torch.randn(12, V, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, V, (12,), generator=g)
    z[1, ::3] = -math.inf                    # a masked vocabulary
    z[2, :300] = -math.inf                   # tile 0 all -inf (tile 256)
    t[2] = 400
    z[3, :] = -math.inf                      # one finite entry
    z[3, V - 50] = 1.5
    t[3] = V - 50
    z[4, 100] = math.inf                     # +inf takes all the mass
    t[4] = 100
    z[5, [30, V - 3]] = math.inf             # two +inf in different tiles
    t[5] = V - 3
    z[6, 5] = math.nan                       # NaN in an ignored row
    t[6] = -100
    z[7, :] = -math.inf                      # all -inf, ignored
    t[7] = -100
    z[8, :] = 0.0                            # all equal: argmax 0
    z[9, :] = -1.0
    z[9, [300, 600]] = 5.0                   # tied maxima in two tiles
    z[10, 17] = -math.inf                    # the target at -inf
    t[10] = 17
    z[11] += 1000.0                          # a large offset
    r = z + torch.randn(12, V, generator=g, dtype=torch.float64) * 0.3
    r[0, ::5] = -math.inf                    # the reference masks where the model does not
    return z.to(dtype), r.to(dtype), t


def group_random_values():
    calls = _route()
    for i, dtype in enumerate(_dtypes()):
        z, r, t = _random((2, 3), 700, dtype, seed=i)
        _check(z, t, nll=True, label=f"{dtype} nll only")        # no entropy / argmax lanes
        _check(z, t, r, label=f"{dtype} ref")
        _check(z, t, r, softcap=5.0, label=f"{dtype} softcap")
        _check(z, None, r, kl=True, argmax=True, label=f"{dtype} no targets")
    assert len(calls) == 12
    print("GROUP OK")


def group_special_values():
    import torch

    calls = _route()
    for dtype in _dtypes():
        z, r, t = _special(700, dtype)
        got = _check(z, t, r, label=f"{dtype} special ref")
        # what the matrix is for, checked directly too
        assert got.nll[4] == 0.0 and got.entropy[4] == 0.0 and got.argmax[4] == 100
        assert got.nll[5] == pytest.approx(math.log(2)) and got.argmax[5] == 30
        assert got.entropy[5] == pytest.approx(math.log(2))
        assert got.nll[3] == 0.0 and got.entropy[3] == 0.0 and got.argmax[3] == 700 - 50
        assert got.nll[6] == 0.0 and got.argmax[6] == -1 and got.argmax[7] == -1
        assert got.argmax[8] == 0 and got.entropy[8] == pytest.approx(math.log(700))
        assert got.argmax[9] == 300
        assert got.nll[10] == math.inf and np.isfinite(got.kl[10])  # both sides mask entry 17
        # softcap: +-inf become +-c, so masked and +inf rows are ordinary
        _check(z, t, r, softcap=30.0, label=f"{dtype} special softcap")
        if dtype != torch.float32:
            continue
        _check(z, t, label=f"{dtype} special")
        # the model masks where the reference does not: KL inf (exact path)
        zm = z.clone()
        zm[0, 1::7] = -math.inf
        got = _check(zm, t, r, label=f"{dtype} model masks")
        assert got.kl[0] == math.inf and np.isfinite(got.kl[1])
        # ... or with the most negative float where the reference puts its
        # mass: KL huge but finite (exact path; the tile sums of the float32
        # terms would overflow)
        zm[0, 1::7] = torch.finfo(torch.float32).min
        rm = r.clone()
        rm[0, 1::7] = 30.0
        got = _check(zm, t, rm, label=f"{dtype} model masks with finfo.min")
        assert 1e38 < got.kl[0] < math.inf
        # +inf in the reference only
        r2 = r.clone()
        r2[1, 2] = math.inf
        _check(z, t, r2, label=f"{dtype} ref +inf")
        # other ignore patterns: a custom ignore_index, every row ignored
        t2 = t.clone()
        t2[::2] = 7
        _check(z, t2, r, ignore_index=7, label=f"{dtype} ignore 7")
        got = _check(z, torch.full_like(t, -100), r, label=f"{dtype} all ignored")
        assert (got.nll == 0).all() and (got.argmax == -1).all() and got.n_counted == 0
        # an all -inf row under a softcap is uniform, not an error
        zc = z.clone()
        zc[0] = -math.inf
        got = _check(zc, t, softcap=10.0, label=f"{dtype} capped all -inf")
        assert got.entropy[0] == pytest.approx(math.log(700))
    assert len(calls) == 3 * 2 + 7
    print("GROUP OK")


def _errors_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


def group_errors():
    import torch

    calls = _route()
    from lmmetrics import _engine

    for dtype in _dtypes():
        z, r, t = _random((2, 5), 600, dtype, seed=3)
        t[:] = 1

        def same_error(z, t, r=None, **kw):
            a = _errors_of(lambda: _engine.run(z, t, r, nll=True, entropy=True, kl=r is not None, **kw))
            b = _errors_of(lambda: _engine.run(_np(z), _np(t), _np(r), nll=True, entropy=True,
                                               kl=r is not None, **kw))
            assert a == b, (a, b)
            return a

        z1 = z.clone()
        z1[0, 3, 500] = math.nan            # row 3
        z1[1, 0, :] = -math.inf             # row 5
        assert same_error(z1, t) == "NaN in logits at row 3 (position (0, 3))"
        r1 = r.clone()
        r1[0, 2, 10] = math.nan
        z3 = z.clone()
        z3[0, 4, 0] = math.nan
        assert same_error(z3, t, r1) == "NaN in reference_logits at row 2 (position (0, 2))"
        if dtype != torch.float32:
            continue
        z2 = z.clone()
        z2[1, 0, :] = -math.inf
        assert "row 5 (position (1, 0)) is all -inf" in same_error(z2, t)
        r2 = r.clone()
        r2[0, 1, :] = -math.inf
        assert "reference_logits row 1" in same_error(z, t, r2)
        z4 = z.clone()
        z4[0, 0, 5] = math.inf              # +inf and NaN in a row: NaN wins
        z4[0, 0, 300] = math.nan
        assert same_error(z4, t).startswith("NaN in logits at row 0")
        # the bad rows are ignored: no error, and the others agree
        t5 = t.clone()
        t5[0, 3] = -100
        t5[1, 0] = -100
        _check(z1, t5, label=f"{dtype} bad rows ignored")
        # a counted target beyond the vocabulary
        t6 = t.clone()
        t6[1, 1] = 600
        assert "out of range" in same_error(z, t6)
        # read on the device, refused after the pass: the first bad row
        # names the error, a target or the logits, as the core names it
        # (targets of int32 are read as they are)
        assert same_error(z1, t6).startswith("NaN in logits at row 3")
        # a row with +inf (redone by the exact path) and NaN before a later
        # bad row: its NaN is the one named, as the core names it
        z7 = z1.clone()
        z7[0, 1, 5] = math.inf
        z7[0, 1, 9] = math.nan
        assert same_error(z7, t6).startswith("NaN in logits at row 1")
        # that row's reference bad too (a NaN, all -inf): +inf hid the
        # logits' NaN from the flags, and the core names the logits first
        r8 = r.clone()
        r8[0, 1, 50] = math.nan
        assert same_error(z7, t, r8).startswith("NaN in logits at row 1")
        r8[0, 1, :] = -math.inf
        assert same_error(z7, t, r8).startswith("NaN in logits at row 1")
        t6[0, 1] = 7000
        assert same_error(z1, t6.int()).startswith("target 7000 at position (0, 1) is out of range")
        # metrics on a bad row raise as the core does
        with pytest.raises(ValueError, match="NaN in logits"):
            lmmetrics.cross_entropy(z1, t)
    assert len(calls) == 2 * 2 + 13, len(calls)
    # lazy logits (chunks of whole rows, on the device until one transfer):
    # a row with +inf and NaN (0 * inf) before a row with NaN
    h, w = inf_and_nan_head(600, 6, bad=1, nan_row=4, seed=5)
    t = torch.arange(6) * 7
    assert same_error(h @ w.T, t).startswith("NaN in logits at row 1")
    for budget in (2 * 600 * 4, None):
        lazy = lmmetrics.projected(h, w, chunk_bytes=budget)
        assert _errors_of(lambda: _engine.run(lazy, t, nll=True)).startswith("NaN in logits at row 1")
    print("GROUP OK")


def group_gpu_path_edges():
    """The rows where the kernel once gave wrong numbers (huge magnitudes,
    finite masks in a partial tile, reference mass the model rules out, a
    float64 reference, bad reference rows): through Triton (a 256 tile and
    the default 2048), with the exact torch path behind it."""
    from helpers import check_gpu_path_edges
    from lmmetrics._engine.cuda import triton as _triton

    calls = _route()
    check_gpu_path_edges("cpu")
    n = len(calls)
    assert n >= 4, n
    _triton._span = _triton.SPAN
    check_gpu_path_edges("cpu")
    assert len(calls) == 2 * n
    print("GROUP OK")


def group_lazy_logits():
    """projected() tensors: each chunk of rows through the Triton kernel."""
    import torch

    calls = _route()
    g = torch.Generator().manual_seed(24)
    h = torch.randn(2, 9, 16, generator=g)
    w = torch.randn(700, 16, generator=g) * 0.5
    t = torch.randint(0, 700, (2, 9), generator=g)
    t[0, 4] = -100
    lazy = lmmetrics.projected(h, w, chunk_bytes=5 * 700 * 4)
    got = lmmetrics.evaluate(lazy, t, shift=True, reference_logits=lmmetrics.projected(h * 0.9, w)).as_dict()
    want = lmmetrics.evaluate((h @ w.T).numpy(), t.numpy(), shift=True,
                              reference_logits=((h * 0.9) @ w.T).numpy()).as_dict()
    for k, v in want.items():
        assert (got[k] is None) if v is None else got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert len(calls) >= 8  # 15 counted rows, 3 a chunk, each in two vocabulary blocks
    # the blocks' values stay and merge on the device: one transfer when the
    # pass ends; a row holding +inf is done again whole after it
    from helpers import HostReads
    from lmmetrics import _engine

    h[1, 5, 0] = 3e38
    kw = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, rank=True, top_logprob=True)
    n = len(calls)
    with pytest.MonkeyPatch.context() as mp:
        reads = HostReads(mp)
        for row, (zh, rh) in enumerate(((h[:1], h[:1] * 0.9), (h, h * 0.9))):
            tn = t[:len(zh)].numpy()
            with reads as events:
                got = _engine.run(lmmetrics.projected(zh, w, chunk_bytes=5 * 700 * 4), tn,
                                  lmmetrics.projected(rh, w), **kw)
            assert events[:2] == ["cpu", "numpy"] and (len(events) > 2) == (row == 1), events
            want = _engine.run((zh @ w.T).numpy(), tn, (rh @ w.T).numpy(), **kw)
            _compare(got, want)
            np.testing.assert_array_equal(got.rank, want.rank)
    assert len(calls) >= n + 8
    # a NaN in a vocabulary block one column wide (V 513 in blocks of 512):
    # the kernel's argmax of that row lies past the tile, where the merge
    # read the row's value (an IndexError; on a GPU, a device-side assert);
    # the row is named as on whole rows
    hn, wn = torch.randn(4, 3, generator=g), torch.randn(513, 3, generator=g)
    hn[1, 0] = math.nan
    for with_ref in (False, True):
        ref = lmmetrics.projected(hn.flip(0), wn, chunk_bytes=1) if with_ref else None
        with pytest.raises(ValueError, match=r"NaN in logits at row 1 "):
            _engine.run(lmmetrics.projected(hn, wn, chunk_bytes=1), np.arange(4), ref, nll=True, kl=with_ref)
    print("GROUP OK")


def group_split_rows():
    """Long rows over several programs; results independent of the launch
    (tiles a program takes, rows a launch holds)."""
    import torch

    calls = _route()
    from lmmetrics._engine.cuda import triton as _triton

    for dtype in _dtypes():
        z, r, t = _random((1,), 3000, dtype, seed=11)   # 12 tiles of 256
        t[0] = 2999
        base = None
        for per in (None, 1, 5, 12) if dtype == torch.float32 else (None, 5):
            _triton._per_prog = per
            got = _check(z, t, r, softcap=None if dtype != torch.float16 else 20.0, label=f"{dtype} split {per}")
            vals = [getattr(got, k).copy() for k in KEYS]
            if base is None:
                base = vals
            for a, b in zip(base, vals):
                np.testing.assert_array_equal(a, b)
        _triton._per_prog = None
        assert _triton._programs_per_row(1, 12, torch.device("cpu")) == 1  # one row: a program a tile
    # eight rows; launches of a few rows each, and whole rows a program
    _triton._span = 512
    z, r, t = _random((8,), 3000, torch.float32, seed=12)
    got1 = _check(z, t, r, label="8 rows")
    old = _triton._STATE_BYTES
    _triton._STATE_BYTES = 3 * 6 * _triton._NFIELDS * 4   # three rows a launch
    _triton._per_prog = 6
    try:
        got2 = _check(z, t, r, label="8 rows, groups of 3")
    finally:
        _triton._STATE_BYTES = old
        _triton._per_prog = None
    for k in KEYS:
        np.testing.assert_array_equal(getattr(got1, k), getattr(got2, k))
    # the default tile (2048), on a Llama-3-sized vocabulary (63 programs)
    _triton._span = _triton.SPAN
    zd, rd, td = _random((1,), 128256, torch.bfloat16, seed=13)
    td[:] = 128255
    got = _check(zd, td, rd, softcap=30.0, label="default tile")
    assert got.n_counted == 1
    _triton._span = 512
    # the summed NLL: float64 sums of the per-row values, 1e-8 relative
    tc = t.clone()
    tc[:] = torch.arange(8) * 300
    s = lmmetrics.cross_entropy(z, tc, reduction="sum")
    s64 = ref_nll(z.double().numpy(), tc.numpy()).sum()
    assert abs(s - s64) <= 1e-8 * s64, (s, s64)
    # ... under a softcap too (1 / c rounded to float would bias every
    # capped logit the same way: 5e-8 relative here; and so would c itself
    # where it is not a float, 77.7: 3.4e-8)
    for cap in (30.0, 77.7):
        s = lmmetrics.cross_entropy(z * 3, tc, reduction="sum", softcap=cap)
        s64 = ref_nll(_capped((z * 3).double().numpy(), cap), tc.numpy()).sum()
        assert abs(s - s64) <= 1e-8 * s64, (cap, s, s64, abs(s - s64) / s64)
    assert len(calls) == 4 + 2 * 2 + 3 + 1 + 2
    print("GROUP OK")


def group_layouts_and_api():
    """Views the engine passes (strided rows, non-viewable blocks), the
    public functions, and what stays on the torch path."""
    import torch

    calls = _route()
    from lmmetrics._engine import cuda as _cuda
    from lmmetrics._engine.cuda import triton as _triton

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 4, 900, generator=g) * 3
    wide[1, 2, 10] = math.inf               # a row for the exact path, in every view
    z = wide[..., :700]                     # row stride 900
    zs = wide[:, :3, :700]                  # not one (rows, V) block
    rz = torch.randn(2, 4, 700, generator=g) * 3
    t = torch.randint(0, 700, (2, 4), generator=g)
    _check(z, t, rz, label="row stride")
    _check(zs, t[:, :3], rz[:, :3], label="blocks")
    _check(z[0, 1], t[0, 1], label="one row (1-D)")
    _check(torch.randn(3, 1, generator=g), torch.tensor([0, -100, 0]), label="V = 1")
    n = len(calls)
    # float64 and a strided vocabulary axis keep the torch path
    _check(z.double(), t, rz.double(), label="float64")
    zt = torch.randn(700, 6, generator=g).t()
    _check(zt, t.reshape(-1)[:6], label="vocabulary stride")
    assert len(calls) == n
    # a row not counted (ignored, negative) or with a target out of range is
    # not read: its programs run no tile (white box: its tile states stay
    # as they were); the targets read and the flags they give
    zi, _, ti = _random((5,), 600, torch.float32, seed=2)
    ti[:] = torch.tensor([5, -100, 599, -5, 600])
    states = torch.full((_triton._NFIELDS, 3, 5), math.nan)
    res = torch.zeros(_triton._N_RESULTS, 5, dtype=torch.float64)
    asked = types.SimpleNamespace(entropy=True, argmax=True, rank=None)
    with np.errstate(all="ignore"):
        _triton._launch(_cuda.describe(zi), None, ti, -100, res, states, 5, 3, asked, 0.0)
    assert states[:, :, [1, 3, 4]].isnan().all() and not states[:5, :, [0, 2]].isnan().any()
    np.testing.assert_allclose(res[1].numpy()[[0, 2]], ref_nll(zi.double().numpy()[[0, 2]], ti.numpy()[[0, 2]]),
                               atol=TOL, rtol=TOL)
    from lmmetrics._engine.cuda.layout import F_COUNTED, F_OOB, RES_FLAGS, RES_TARGETS

    np.testing.assert_array_equal(res[RES_TARGETS].numpy(), ti.numpy())
    np.testing.assert_array_equal(res[RES_FLAGS].numpy(), [F_COUNTED, 0, F_COUNTED, 0, F_COUNTED | F_OOB])
    # the public functions
    nll = lmmetrics.token_nll(z, t)
    assert isinstance(nll, torch.Tensor) and nll.shape == t.shape
    np.testing.assert_allclose(nll.numpy(), ref_nll(z.double().numpy(), t.numpy()), atol=TOL, rtol=TOL)
    got = lmmetrics.evaluate(z, t, reference_logits=rz).as_dict()
    want = lmmetrics.evaluate(z.numpy(), t.numpy(), reference_logits=rz.numpy()).as_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert (got[k] is None) if v is None else got[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert len(calls) > n
    # a negative view (is_neg(): its memory holds the values negated) is read as its values
    m = len(calls)
    zn, rn = torch._neg_view(z), torch._neg_view(rz)
    neg_z, neg_r = (-z).double().numpy(), (-rz).double().numpy()
    np.testing.assert_allclose(lmmetrics.token_nll(zn, t).numpy(), ref_nll(neg_z, t.numpy()), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(lmmetrics.token_kl(zn, reference_logits=rn).numpy(), ref_kl(neg_r, neg_z), atol=TOL,
                               rtol=TOL)
    tn = torch._neg_view(-t)  # the kernel reads the targets' memory too
    np.testing.assert_array_equal(lmmetrics.token_nll(z, tn).numpy(), lmmetrics.token_nll(z, t).numpy())
    assert len(calls) > m
    # the kernel's tanh (softcap) against float64 over a wide range
    import triton
    import triton.language as tl

    globals()["_kernel_tanh"] = _triton._tanh  # a jit function reads module globals

    @triton.jit
    def tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + o, mask=o < n)
        tl.store(y_ptr + o, _kernel_tanh(x), mask=o < n)  # noqa: F821

    x = torch.cat([torch.linspace(-3, 3, 2001), torch.tensor([0.0, 1e-30, -1e-8, 0.2999, 0.3001, 20.0, 50.0,
                                                                 -100.0, math.inf, -math.inf])])
    y = torch.empty_like(x)
    with np.errstate(all="ignore"):
        tanh_kernel[(1,)](x, y, x.numel(), BLOCK=4096)
    want = np.tanh(x.double().numpy())
    err = np.abs(y.double().numpy() - want) / np.maximum(np.abs(want), 1e-30)
    assert err.max() < 4e-7, err.max()
    y = torch.tensor([math.nan])
    tanh_kernel[(1,)](torch.tensor([math.nan]), y, 1, BLOCK=2)
    assert math.isnan(y.item())
    assert _cuda._triton_for is not None
    print("GROUP OK")


def group_rank_and_top_logprob():
    """The rank (the logits above the target's, and those equal to it at a
    lower column: ties across lanes, tiles and spans) and top_logprob
    (-log S) from the kernel, in its one launch, against the core, the rows
    the exact path redoes (+inf) included; with a softcap on a grid of
    values (no near-ties for the two cappings' last bits to split)."""
    import torch

    from lmmetrics import _engine

    calls = _route()
    g = torch.Generator().manual_seed(11)
    z = torch.round(torch.randn(3, 5, 1100, generator=g) * 48) / 16  # a grid: exact ties, no near-ties
    z[0, 1, 7] = math.inf
    t = torch.randint(0, 1100, (3, 5), generator=g)
    t[1, 2] = -100
    z[2, 0, :] = 0.5                          # every column tied: rank = the target's column
    z[2, 1, :] = -math.inf                    # the target at -inf: every finite logit above it
    z[2, 1, 1000:] = 1.0
    z[2, 2, [3, 700, 1099]] = 40.0            # the max tied across spans, the target at its last
    t[2, 2] = 1099
    z[2, 3, [3, 700, 1099]] = 40.0            # ... and at its first
    t[2, 3] = 3
    r = torch.randn(3, 5, 1100, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        for cap in (None, 20.0):
            x = z.to(dtype)
            kw = dict(softcap=cap, nll=True, rank=True, top_logprob=True)
            want = _engine.run(_np(x), t.numpy(), **kw)
            n = len(calls)
            got = _engine.run(x, t, **kw)
            assert len(calls) == n + 1, "the rank took the torch path"
            np.testing.assert_array_equal(got.rank, want.rank)
            if cap is None:
                # (row 11: the 100 finite ones, and the -inf ones before the target, tied with it)
                t21 = int(t[2, 1])
                assert got.rank[10:14].tolist() == [t[2, 0], 100 + t21 if t21 < 1000 else t21 - 1000, 2, 0]
            np.testing.assert_allclose(got.top_logprob, want.top_logprob, atol=TOL, rtol=TOL)
            np.testing.assert_allclose(got.nll, want.nll, atol=TOL, rtol=TOL)
            alone = _engine.run(x, t, softcap=cap, rank=True)
            np.testing.assert_array_equal(alone.rank, want.rank)
            every = _engine.run(x, t, r.to(dtype), softcap=cap, rank=True, nll=True, entropy=True, argmax=True,
                                kl=True)
            np.testing.assert_array_equal(every.rank, want.rank)
            assert len(calls) == n + 3
    print("GROUP OK")


def group_one_transfer():
    """The kernel's launches over many groups of rows write into the pass's
    buffer on the device; the values cross to the host once, after the last
    launch (rows the kernel cannot certify: after that, by the exact path),
    and are the core's."""
    import torch

    from helpers import HostReads
    from lmmetrics import _engine
    from lmmetrics._engine.cuda import triton as _triton

    calls = _route()
    z, r, t = _random((40,), 700, torch.float32, seed=31)
    t[::6] = -100
    tn = t.numpy()
    old = lmmetrics.set_cuda_chunk_bytes(2 * 3 * _triton._NFIELDS * 4 * 3)  # 3 rows (3 spans each) a group
    try:
        with pytest.MonkeyPatch.context() as mp:
            reads = HostReads(mp)

            kw = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, top_logprob=True)
            with reads as events:
                mp.setattr(_triton, "_spans", _Counted(_triton._spans, events, "chunk"))
                got = _engine.run(z, tn, r, **kw)
            n = events.count("chunk")
            assert n > 10 and events == ["chunk"] * n + ["cpu", "numpy"], events
            _compare(got, _engine.run(_np(z), tn, _np(r), **kw))
            z[7, 3] = math.inf  # a row the exact path redoes, after the one transfer
            with reads as events:
                got = _engine.run(z, tn, r, **kw)
            assert events == ["chunk"] * n + ["cpu", "numpy"] * 2, events
            _compare(got, _engine.run(_np(z), tn, _np(r), **kw))
    finally:
        lmmetrics.set_cuda_chunk_bytes(old)
    assert calls
    print("GROUP OK")


def group_span_edges():
    """The lane-row accumulators where they could go wrong (spans of 256:
    tiles of 128): a lane-row whose max jumps by more than float's range
    between tiles, a max tied across a later tile, an earlier lane-row and a
    later span (the first wins), near one-hot rows, a 1e6 offset with a
    small spread, a whole span of -inf, a NaN alone in an otherwise -inf
    lane-row; then the same bits whatever the spans a program takes, the
    rows a launch holds, or a [..., :-1, :] view against its copy."""
    import torch

    from lmmetrics import _engine
    from lmmetrics._engine.cuda import triton as _triton

    _route()
    g = torch.Generator().manual_seed(17)
    V = 1601
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(7, V, generator=g) * 3
        t = torch.randint(0, V, (7,), generator=g)
        z[0, 8] = -3.0e38
        z[0, 8 + 128] = 3.0e38 if dtype == torch.float32 else 3.0e38 / 2
        t[0] = 8 + 128
        z[1, [300, 44, 1500]] = 40.0
        z[2, :] = -1e4
        z[2, 77] = 1e4
        z[3] = z[3] * 1e-3 + 1e6
        z[4, ::2] = -math.inf
        t[4] = 1
        z[5, 1024:] = -math.inf
        t[5] = 3
        r = (z + torch.randn(7, V, generator=g)).to(dtype)
        r[5, 1024:] = -math.inf
        x = z.to(dtype)
        for cap in (None, 30.0):
            got = _check(x, t, r, softcap=cap, label=f"{dtype} {cap}")
            assert got.argmax[1] == 44
        nan = x.clone()
        nan[6, :] = -math.inf
        nan[6, 130] = math.nan
        with pytest.raises(ValueError, match="NaN in logits at row 6"):
            _engine.run(nan, t, nll=True, entropy=True)
        # the same bits whatever the launch
        kw = dict(nll=True, entropy=True, argmax=True, kl=True, rank=True, top_logprob=True)
        base = _engine.run(x, t, r, **kw)
        for per in (1, 2, 3):
            _triton._per_prog = per
            _compare_bits(_engine.run(x, t, r, **kw), base, f"{per} spans a program")
        _triton._per_prog = None
        old = lmmetrics.set_cuda_chunk_bytes(2 * 7 * _triton._NFIELDS * 4 * 2)  # 2 rows a launch
        try:
            _compare_bits(_engine.run(x, t, r, **kw), base, "2 rows a launch")
        finally:
            lmmetrics.set_cuda_chunk_bytes(old)
    wide = torch.randn(3, 6, 700, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 700, (3, 6), generator=g)
    kw = dict(nll=True, entropy=True, argmax=True, rank=True)
    view = _engine.run(wide, ids, shift=True, **kw)
    copy = _engine.run(wide[:, :-1].contiguous(), ids[:, 1:].contiguous(), **kw)
    _compare_bits(view, copy, "a view and its copy")
    print("GROUP OK")


def _compare_bits(got, want, label):
    for k in ("nll", "entropy", "argmax", "kl", "rank", "top_logprob"):
        a, b = getattr(got, k), getattr(want, k)
        if a is not None or b is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"{label}: {k}")


class _Counted:
    """A jitted kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel, events, name):
        self.kernel, self.events, self.name = kernel, events, name

    def __getitem__(self, grid):
        self.events.append(self.name)
        return self.kernel[grid]


def group_targets_stay_on_the_device():
    """Targets given as tensors on the logits' device are read there: no host
    read before the pass's one transfer, no upload, one launch of each
    kernel for a whole (B, T, V) batch with shift=True (the [..., :-1, :]
    view and the targets[..., 1:] view as they are), a target out of range
    or a NaN named after that one transfer; values as the core's."""
    import torch

    from helpers import HostReads
    from lmmetrics import _engine
    from lmmetrics._engine import cuda as _cuda
    from lmmetrics._engine.cuda import triton as _triton

    _route()
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 9, 700, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 700, (3, 9), generator=g)
    ids[1, 4] = -100
    kw = dict(nll=True, entropy=True, argmax=True, top_logprob=True)
    with pytest.MonkeyPatch.context() as mp:
        reads = HostReads(mp)
        with reads as events:
            mp.setattr(_triton, "_spans", _Counted(_triton._spans, events, "tiles"))
            mp.setattr(_triton, "_merge", _Counted(_triton._merge, events, "merge"))
            mp.setattr(_cuda, "to_device", lambda *a: events.append("upload") or to_device(*a))
            to_device = _engine.device.to_device
            for t in (ids, ids.int()):
                events.clear()
                got = _engine.run(z, t, shift=True, **kw)
                assert events == ["tiles", "merge", "cpu", "numpy"], events
                want = _engine.run(_np(z), ids.numpy(), shift=True, **kw)
                _compare(got, want, kw)
                np.testing.assert_array_equal(got.targets, ids[:, 1:].reshape(-1).numpy())
                np.testing.assert_array_equal(got.counted, want.counted)
                assert got.n_counted == want.n_counted == 3 * 8 - 1
            bad = ids.clone()
            bad[2, 6] = 700
            events.clear()
            # (named where it is in the ids given: the pass read ids[:, 1:])
            with pytest.raises(ValueError, match=r"target 700 at position \(2, 6\) is out of range"):
                _engine.run(z, bad, shift=True, nll=True)
            assert events[:4] == ["tiles", "merge", "cpu", "numpy"], events
            # host targets: checked on the host for their dtype and shape, uploaded once
            host = ids[:, 1:].contiguous()
            host = host.numpy()
            events.clear()
            _engine.run(z[:, :-1], host, nll=True)
            assert events == ["upload", "tiles", "merge", "cpu", "numpy"], events
    print("GROUP OK")


def _sm90_compile_problem():
    """Why this triton cannot compile for sm_90 without a GPU through
    ASTSource (a trivial kernel: a failure there skips a group, a failure on
    lmmetrics' kernels fails it); None when it can."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmmetrics._engine.cuda import triton as _triton

    @triton.jit
    def probe(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK).to(tl.float32))

    try:
        triton.compile(ASTSource(fn=probe, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"},
                                 constexprs={(1,): 16}), target=GPUTarget("cuda", 90, 32),
                       options=dict(_triton._OPTIONS)).asm["cubin"]
    except Exception as e:  # pragma: no cover - depends on the triton build
        return e
    return None


def _stubbed_driver():
    """Triton's active driver replaced by one for an sm_90 device that
    loads nothing and records each launch (launcher, arguments) instead of
    running it; None (with a SKIP line) when this triton cannot compile for
    sm_90 here."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    problem = _sm90_compile_problem()
    if problem is not None:
        print(f"SKIP: this triton does not compile for sm_90 here through ASTSource ({problem!r})")
        return None
    launches = []

    class Launcher:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args):
            launches.append((self, args))

    class Utils:
        def load_binary(self, name, kernel, shared, device):
            return 11, 22, 32, 0, 1024  # module, function, registers, spills, threads

        def get_device_properties(self, device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        def unload_module(self, module):
            pass

    class Driver:
        utils = Utils()
        launcher_cls = Launcher

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 7

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_device_interface(self):
            return torch.cuda

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Driver())
    return launches


def group_sync_false():
    """cross_entropy / perplexity with sync=False on the Triton path: the two
    launches and no host read in the call nor in ``.value`` (summed on the
    device from the kernel's flags and values); ``float()`` reads once and
    gives the synchronous call's bits, ``.value`` the same to float64
    rounding; a target out of range or a NaN row: ``.value`` NaN,
    ``float()`` raises as the synchronous call does; a +inf row: ``.value``
    NaN, ``float()`` the exact path's value."""
    import torch

    from helpers import HostReads
    from lmmetrics._engine.cuda import triton as _triton

    _route()
    g = torch.Generator().manual_seed(8)
    z = torch.randn(3, 9, 700, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 700, (3, 9), generator=g)
    ids[1, 4] = -100
    want = torch.nn.functional.cross_entropy(z[:, :-1].double().reshape(-1, 700), ids[:, 1:].reshape(-1),
                                             ignore_index=-100)
    with pytest.MonkeyPatch.context() as mp:
        reads = HostReads(mp)
        mp.setattr(_triton, "_spans", _Counted(_triton._spans, [], "tiles"))
        for fn, of in ((lmmetrics.cross_entropy, float(want)), (lmmetrics.perplexity, math.exp(want))):
            with reads as events:
                d = fn(z, ids, shift=True, sync=False)
                value = d.value
                assert events == [], events
                got = float(d)
                assert events == ["cpu", "numpy"], events
            assert got == fn(z, ids, shift=True) and got == pytest.approx(of, rel=2e-6)
            assert float(value) == pytest.approx(got, rel=1e-12) and value.dtype == torch.float64
        for t, at, match in ((ids.clone(), (2, 6), r"target 700 at position \(2, 6\)"),
                             (ids, (1, 2), r"NaN in logits at row 11 \(position \(1, 2\)\)")):
            bad = z.clone()
            if t is ids:
                bad[at] = math.nan
            else:
                t[at] = 700
            d = lmmetrics.cross_entropy(bad, t, shift=True, sync=False)
            assert torch.isnan(d.value)
            for _ in range(2):
                with pytest.raises(ValueError, match=match):
                    float(d)
        inf = z.clone()
        inf[0, 2, 5] = math.inf
        d = lmmetrics.cross_entropy(inf, ids, shift=True, sync=False)
        assert torch.isnan(d.value)
        assert float(d) == lmmetrics.cross_entropy(inf, ids, shift=True) == pytest.approx(
            lmmetrics.cross_entropy(_np(inf), ids.numpy(), shift=True), rel=2e-6)
    print("GROUP OK")


def group_direct_launch():
    """Launches past Triton's binder (triton._run): on a stubbed driver, each
    later launch of a specialization hands the compiled kernel's launcher
    exactly what Triton's own launch does (grid, stream, function,
    metadata, hooks, every argument) and goes to the kernel Triton picks,
    over cases that differ in what Triton specializes on (dtypes, a
    logits pointer off 16 bytes, a vocabulary of a multiple of 16, one row,
    strides, targets, a reference, a softcap, the rank), in one cache."""
    import torch
    from triton.runtime.jit import JITFunction

    from lmmetrics import _engine
    from lmmetrics._engine import cuda as _cuda, inputs as _inputs
    from lmmetrics._engine.cuda import triton as _triton

    if not _triton._direct:
        print(f"SKIP: launches go through triton's own launcher with this triton ({_triton.triton.__version__})")
        return
    launches = _stubbed_driver()
    if launches is None:
        return
    _inputs.is_cuda = lambda x: isinstance(x, torch.Tensor)
    _cuda._force_triton = True
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 6, 1000, generator=g)
    ids = torch.randint(0, 1000, (4, 6), generator=g)
    wide = torch.randn(3, 40000, generator=g)
    strided = torch.randint(0, 1000, (6, 16), generator=g)
    big8 = torch.zeros(2**31 + 8, dtype=torch.int8)  # (pages never touched: no memory)
    cases = [
        (z.bfloat16(), ids, None, dict(shift=True, nll=True)),
        (z[..., :-1].bfloat16(), ids, None, dict(shift=True, nll=True, entropy=True, argmax=True)),
        (z.bfloat16()[..., 1:], ids, None, dict(shift=True, nll=True)),      # logits off 16 bytes
        (z[..., :992], ids % 992, None, dict(shift=True, nll=True, entropy=True, argmax=True, rank=True)),
        (z[:1, :2].half(), ids[:1, :2], None, dict(shift=True, nll=True)),    # one row
        (z[0], ids[0].int(), z[1].bfloat16(), dict(shift=False, nll=True, kl=True)),
        (z[0], None, z[1], dict(kl=True, entropy=True, argmax=True)),
        (z.bfloat16(), ids, None, dict(shift=True, nll=True, softcap=30.0)),
        (wide, torch.tensor([5, 39999, 20000]), None, dict(shift=False, nll=True, entropy=True, top_logprob=True)),
        (z.bfloat16(), ids, None, dict(shift=True, nll=True)),               # the first case again
        # ... and cases that differ from the last in one thing: a vocabulary
        # of a multiple of 16; targets at stride 1, 16, 3, past int32 (the
        # views of a 2 GiB buffer never touched); int32 / int16 targets;
        # float16 logits (bfloat16's layout); logits 8 and 4 bytes off 16
        (z.bfloat16()[..., :992], ids % 992, None, dict(shift=True, nll=True)),
        (z[0].bfloat16(), ids[0], None, dict(shift=False, nll=True)),
        (z[0].bfloat16(), strided[:, 0], None, dict(shift=False, nll=True)),
        (z[0].bfloat16(), strided.view(-1)[::3][:6], None, dict(shift=False, nll=True)),
        (z[0].bfloat16(), ids[0].int(), None, dict(shift=False, nll=True)),
        (z[0].bfloat16(), ids[0].to(torch.int16), None, dict(shift=False, nll=True)),
        (z[0].half(), ids[0], None, dict(shift=False, nll=True)),
        (z.bfloat16()[..., 4:], ids % 996, None, dict(shift=True, nll=True)),
        (z.bfloat16()[..., 2:], ids % 998, None, dict(shift=True, nll=True)),
        (z[0, :2].bfloat16(), big8.as_strided((2,), (3,)), None, dict(shift=False, nll=True)),
        (z[0, :2].bfloat16(), big8.as_strided((2,), (2**31 + 3,)), None, dict(shift=False, nll=True)),
        (z[0, :2].bfloat16(), big8.as_strided((2,), (2**31 - 13,)), None, dict(shift=False, nll=True)),
    ]
    jit_runs = []
    run = JITFunction.run
    JITFunction.run = lambda self, *a, **k: jit_runs.append(1) or run(self, *a, **k)

    def launched(case):
        launches.clear()
        jit_runs.clear()
        logits, targets, reference, kw = case
        try:  # (the stubbed launches compute nothing: what the pass then reads is undefined)
            _engine.run(logits, targets, reference, **kw)
        except Exception:
            pass
        inputs = [x for x in (logits, targets, reference) if x is not None]
        return [(launcher, [_described(a, inputs) for a in args]) for launcher, args in launches], len(jit_runs)

    for i, case in enumerate(cases):
        _triton._direct = False
        want, n_jit = launched(case)
        assert len(want) == 2 and n_jit == 2, (i, want, n_jit)
        _triton._direct = True
        launched(case)  # through Triton the first time the cache does not hold the specialization
        got, n_jit = launched(case)
        assert n_jit == 0, (i, n_jit)
        assert len(got) == 2, (i, got)
        for (lg, ag), (lw, aw) in zip(got, want):
            assert lg is lw, f"case {i}: another compiled kernel than triton's"
            assert ag == _as_direct(aw), f"case {i}:\n{ag}\n{aw}"
    assert len({id(k) for k in _triton._compiled.values()}) == len(_triton._compiled) >= 2 * 16
    print("GROUP OK")


def group_direct_launch_probe():
    """The kernel and arguments triton._run launches against Triton's own
    launch, on a stubbed driver, for two small kernels (one with
    do_not_specialize) over integers at every boundary Triton types or
    specializes on, tensors at every byte offset and of many dtypes,
    floats, warps, constexprs and two devices, in one cache; and after the
    settings Triton reads at each launch (debug, instrumentation) change
    either way, and with a launch hook added later."""
    import torch
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.runtime.driver import driver

    from lmmetrics._engine.cuda import triton as _triton

    if not _triton._direct:
        print(f"SKIP: launches go through triton's own launcher with this triton ({triton.__version__})")
        return
    launches = _stubbed_driver()
    if launches is None:
        return
    dev = [0]
    driver.active.get_current_device = lambda: dev[0]

    def body(x_ptr, y_ptr, n, m, f, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        o = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + o * m, mask=o < n).to(tl.float32) * f
        if FLAG:
            v = v + 1
        tl.store(y_ptr + o * n, v.to(y_ptr.dtype.element_ty), mask=o < m)

    probe, probe_dns = triton.jit(body), triton.jit(do_not_specialize=("n",))(body)

    base = torch.zeros(64)
    b8 = torch.zeros(64, dtype=torch.int8)
    ints = [0, 1, -1, 2, 15, 16, 17, 32, -16, -15, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**32, 2**32 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1, -2**63,
            2**64 + 16, 2**64 + 3, -2**63 - 16, -2**63 - 3]  # (past 64 bits: refused, after their classes' kernels)
    xs = [base, base[1:], base[2:], base[4:], b8, b8[1:], b8[2:], b8[4:], b8[8:], b8[15:], b8[16:], base.bfloat16(),
          base.bfloat16()[1:], base.bfloat16()[8:], base.double()[1:], base.bool(), base.int(), base.long(),
          torch.nn.Parameter(base.clone()), base.view(8, 8).t()[0], base.view(torch.uint8)[1:]]
    cases = []
    for fn in (probe, probe_dns):
        cases += [(fn, (x, base, 8, 8, 1.0), dict(BLOCK=16, FLAG=True), 4, 0) for x in xs]
        cases += [(fn, (base, base, n, m, 2.0), dict(BLOCK=16, FLAG=False), 4, 0) for n in ints for m in (1, 3, 16)]
        # (an integer and a float in one place: -1 once keyed as every float)
        cases += [(fn, (base, base[4:], 5, 7, f), dict(BLOCK=16, FLAG=True), 4, 0) for f in (-1, 0.0, -0.0, 1e300, 3)]
        cases += [(fn, (base, base, 3, 5, 0.5), dict(BLOCK=16, FLAG=flag), w, d)
                  for w in (1, 4) for flag in (True, False) for d in (0, 1)]

    def launched(how, fn, args, cons, w):
        launches.clear()
        try:
            if how == "triton":
                fn[(1,)](*args, **cons, num_warps=w, **_triton._OPTIONS)
            else:
                _triton._run(fn, (1,), args, cons, w)
        except Exception as e:  # (Triton refuses 2^64 - 1 as it refuses -2^63 - 1: so must the direct call)
            return type(e).__name__
        (launcher, got), = launches
        return launcher, [("metadata", dict(a.data), list(a.extras)) if type(a).__name__ == "LazyDict" else a
                          for a in got]

    def same(fn, args, cons, w=4, label=""):
        want = launched("triton", fn, args, cons, w)
        got = launched("_run", fn, args, cons, w)
        # (the first launch of a key is Triton's own: its hooks and metadata)
        assert type(got) is type(want) and (got == want if isinstance(got, str) else got[0] is want[0] and (
            got[1] == _as_direct(want[1]) or got[1] == want[1])), (label, got, want)

    for rnd in range(2):  # the second time round, every key is cached
        for i, (fn, args, cons, w, d) in enumerate(cases):
            dev[0] = d
            same(fn, args, cons, w, label=(rnd, i, fn is probe_dns, args[2:], cons, w, d))
    dev[0] = 0
    assert len(_triton._compiled) > 60, len(_triton._compiled)
    # values not seen (the front cache forgotten, and kept small) go to the
    # kernel of their specialization: no launch through Triton
    from triton.runtime.jit import JITFunction

    keep, run, jit = _triton._MAX_SEEN, JITFunction.run, []
    _triton._MAX_SEEN = 5
    _triton._seen.clear()
    JITFunction.run = lambda self, *a, **k: jit.append(1) or run(self, *a, **k)
    try:
        for i, (fn, args, cons, w, d) in enumerate(cases[:12]):
            same(fn, args, cons, w, label=("values not seen", i))
            assert len(_triton._seen) <= 5
    finally:
        _triton._MAX_SEEN = keep
        JITFunction.run = run
    assert len(jit) == 12, len(jit)  # (same()'s own launch through Triton, each case; none of _run's)
    # the settings Triton adds to each launch's options, turned on and off
    args, cons = (base, base, 3, 8, 1.0), dict(BLOCK=16, FLAG=True)
    settings = [(knobs.runtime, "debug", True), (knobs.compilation, "instrumentation_mode", "fpsan")]
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        settings.append((knobs.compilation, "fpsan_homomorphic_casts", True))
    for obj, attr, value in settings:
        old = getattr(obj, attr)
        for v in (value, old):  # on after the plain kernel's launches, off after the other's
            setattr(obj, attr, v)
            try:
                same(probe, args, cons, label=attr)
                same(probe, args, cons, label=attr)
            finally:
                setattr(obj, attr, old)
    # a launch hook added after the first launches (a profiler): the same metadata
    seen = []
    hook = lambda md: seen.append(dict(md.get()))  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        same(probe, args, cons, label="hook")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)

    # a hook set in place of Triton's chain, which records its calls in a
    # list of its own named `calls` (empty until it is first called): called
    class Recorder:
        def __init__(self):
            self.calls = []

        def __call__(self, md):
            self.calls.append(md)

    for attr in ("launch_enter_hook", "launch_exit_hook"):
        old, rec = getattr(knobs.runtime, attr), Recorder()
        setattr(knobs.runtime, attr, rec)
        try:
            same(probe, args, cons, label=attr)
            got = launched("_run", probe, args, cons, 4)
            assert rec in got[1][7:9], (attr, got[1][6:9])
        finally:
            setattr(knobs.runtime, attr, old)
    print("GROUP OK")


def _as_direct(args):
    """The arguments of Triton's own launch as the direct launch passes
    them: with no launch hook set (None, or Triton's empty chain), no hooks and
    no launch metadata (the kernel launcher's arguments 6-8), as a Triton
    without hooks passes them."""
    from triton import knobs

    if all(h is None or (type(h) is getattr(knobs, "HookChain", None) and h.calls == [])
           for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)):
        return [*args[:6], None, None, None, *args[9:]]
    return list(args)


def _described(a, inputs):
    """A launch argument as comparable across two passes: a tensor by its
    dtype, shape, strides and 16-byte alignment (its address too when it is
    one of the pass's inputs), the launch metadata by its contents."""
    import torch

    if isinstance(a, torch.Tensor):
        own = any(a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs)
        return ("tensor", a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16, own and a.data_ptr())
    if type(a).__name__ == "LazyDict":
        return ("metadata", dict(a.data), list(a.extras))
    return a


def _compare(got, want, keys=None):
    if keys is not None:
        for k in keys:
            np.testing.assert_allclose(getattr(got, k), getattr(want, k), rtol=TOL, atol=TOL, err_msg=k)
        return
    for k in KEYS + ("top_logprob",):
        a, b = getattr(got, k), getattr(want, k)
        if "argmax" in k:
            np.testing.assert_array_equal(a, b, err_msg=k)
        else:
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=k)


def group_bench_smoke():
    """The CUDA benchmark's code on tiny CPU tensors (interpreted): its table
    and its accuracy check; its timings mean nothing here."""
    calls = _route()
    from lmmetrics.cli.bench import cuda as _bench_cuda

    lines = []
    rc = _bench_cuda.bench_cuda(tokens=2, vocab=600, dtypes=("bfloat16",), repeat=1, few_rows=1,
                                device="cpu", print_fn=lines.append)
    text = "\n".join(lines)
    print(text)
    assert rc == 0, text
    assert text.count("read-only pass") == 2 and text.count("torch path: cross_entropy") == 2
    assert "2 x 600 bfloat16" in text and "1 x 600 bfloat16" in text
    # per table: the check, cross_entropy and two evaluates (each warmed up)
    assert len(calls) == 2 * 7, len(calls)
    print("GROUP OK")


def group_compile_sm90():
    """Compile the kernels for sm_90 and sm_80 (no GPU needed) at the chosen
    tile and warps; no register spills, no local memory."""
    import shutil
    import tempfile

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.backends.nvidia import compiler as nvc
    except Exception as e:  # pragma: no cover - depends on the triton build
        print(f"SKIP: this triton cannot compile for CUDA here ({e!r})")
        return
    from lmmetrics._engine.cuda import triton as _triton

    cuobjdump = os.path.join(os.path.dirname(nvc.__file__), "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        cuobjdump = shutil.which("cuobjdump")
    if not cuobjdump:
        print("SKIP: no cuobjdump bundled with this triton")
        return
    problem = _sm90_compile_problem()
    if problem is not None:
        print(f"SKIP: this triton does not compile for sm_90 here through ASTSource ({problem!r})")
        return

    # the bounds below hold from triton 3.8 on; before it (3.6 in the GPU
    # image here, 3.7.1 with torch 2.13's CUDA wheels) the same loops take
    # more registers (float32 evaluate 56-64, KL 168) and 3.6 gives one
    # variant a 16-byte stack frame: checked there, no spill (no local
    # memory) and the loops' lengths; 3.8 gives the float16 capped KL +
    # rank variant (the cap's low part, cap_lo, one more live value) an
    # 8-byte frame, no spill either
    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    older = version < (3, 8)
    framed = version < (3, 9)

    def frame_ok(stack, local):
        return local == 0 and (stack == 0 or framed)

    def usage(fn, sig, cons, warps, arch=90, aligned=()):
        """(registers, stack, local memory, PTX, SASS) of fn compiled for
        sm_<arch>; aligned: the arguments marked divisible by 16, as the
        launcher marks them when they are (pointers from torch, a
        vocabulary of a multiple of 16)."""
        idx = {(fn.arg_names.index(k),): v for k, v in cons.items()}
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned if k in sig}
        k = triton.compile(ASTSource(fn=fn, signature=dict(sig, **{c: "constexpr" for c in cons}),
                                     constexprs=idx, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, **_triton._OPTIONS})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        try:
            rep = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 check=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        finally:
            os.unlink(f.name)
        line = [ln for ln in rep.splitlines() if "REG:" in ln][0]
        fields = dict(kv.split(":") for kv in line.split() if ":" in kv)
        return int(fields["REG"]), int(fields["STACK"]), int(fields["LOCAL"]), k.asm["ptx"], sass

    def inner_loop(sass):
        """The SASS instructions of the innermost loop: the shortest span of
        a conditional branch backwards."""
        best = None
        for ln in sass.splitlines():
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", ln)
            if m and int(m.group(2), 16) < int(m.group(1), 16):
                n = (int(m.group(1), 16) - int(m.group(2), 16)) // 16 + 1
                best = n if best is None else min(best, n)
        return best

    rows_sig = {f"{p}_{k}": "i64" for p in "zrt" for k in ("inner", "stride", "outer")}
    spans_sig = {"z_ptr": "*bf16", "r_ptr": "*bf16", "tgt_ptr": "*i64", "st_ptr": "*fp32", "row0": "i64",
                 "n_rows": "i32", "n_cols": "i32", **rows_sig, "ignore": "i64", "n_spans": "i32",
                 "per_prog": "i32", "cap": "fp32", "cap_lo": "fp32", "inv_cap": "fp32", "inv_lo": "fp32"}
    aligned = ("z_ptr", "r_ptr", "tgt_ptr", "st_ptr", "n_cols", "z_stride", "r_stride", "z_outer", "r_outer")
    off = dict(HAS_REF=False, WANT_ENT=False, WANT_AMAX=False, WANT_RANK=False, CAPPED=False)
    # (variant, its asks, SASS instructions an element of its loop at most, registers at most):
    # the budget at 0.85 of an H100's read is ~23 an element in 16 bits,
    # ~47 in 32 (a KL pair: ~50); registers bound the warps a multiprocessor holds
    variants = (("nll", {}, 11, 40), ("evaluate", dict(WANT_ENT=True, WANT_AMAX=True), 15, 48),
                ("evaluate+rank", dict(WANT_ENT=True, WANT_AMAX=True, WANT_RANK=True), 20, 96),
                # (float32's KL: 30.8 with triton 3.9, 32.25 with 3.8, since its update takes the model's
                # shift move unclamped; a float32 pair's budget is ~50)
                ("kl", dict(HAS_REF=True, WANT_ENT=True, WANT_AMAX=True), 33, 160),
                ("kl+capped+rank", dict(HAS_REF=True, WANT_ENT=True, WANT_AMAX=True, WANT_RANK=True,
                                        CAPPED=True), None, 255))
    for dt, name in (("*fp32", "float32"), ("*bf16", "bfloat16"), ("*fp16", "float16")):
        vec, lrows, tps, warps = _triton.geometry(name)
        per_thread = lrows * vec // (32 * warps)  # elements a thread reads a tile
        sig = dict(spans_sig, z_ptr=dt, r_ptr=dt)
        for label, asks, per_elem, regs in variants:
            cons = dict(VEC=vec, LROWS=lrows, TPS=tps, HAS_TGT=True, **dict(off, **asks))
            reg, stack, local, ptx, sass = usage(_triton._spans, sig, cons, warps, aligned=aligned)
            loop = inner_loop(sass)
            print(name, label, "registers", reg, "loop", loop, "an element", loop / per_thread)
            assert frame_ok(stack, local) and (reg <= regs or older), (name, label, reg, stack, local)
            if per_elem is not None:
                assert loop / per_thread <= per_elem, (name, label, loop / per_thread)
            # 16-byte loads, one a lane-row a tile (two with the reference), read once (evict first)
            loads = len(re.findall(r"LDG\.E\.EF\.128", sass))
            assert loads == per_thread // vec * (2 if asks.get("HAS_REF") else 1), (name, label, loads)
            # no reduction across threads in the tile loop: as many shuffles and
            # barriers with twice the tiles a span
            twice = usage(_triton._spans, sig, dict(cons, TPS=2 * tps), warps, aligned=aligned)[4]
            for op in ("SHFL", "BAR"):
                assert sass.count(op) == twice.count(op), (name, label, op)
    merge_sig = {"st_ptr": "*fp32", "z_ptr": "*bf16", "r_ptr": "*bf16", "tgt_ptr": "*i64", "out_ptr": "*fp64",
                 "n_rows": "i32", "row0": "i64", "n_total": "i64", "n_cols": "i32", "n_spans": "i32", **rows_sig,
                 "ignore": "i64", "cap": "fp32", "cap_lo": "fp32"}
    every = dict(HAS_TGT=True, HAS_REF=True, WANT_ENT=True, WANT_RANK=True, CAPPED=True)
    for ns in (8, _triton._MERGE_ELEMS):  # V = 128256, the most spans the path takes
        rows = max(1, min(16, _triton._MERGE_ELEMS // ns))
        reg, stack, local = usage(_triton._merge, merge_sig, dict(ROWS=rows, NS=ns, **every), 4)[:3]
        print("merge", ns, reg, stack, local)
        assert frame_ok(stack, local), (ns, reg, stack, local)
    # the other variants: no targets (entropy, KL only), and a vocabulary of
    # one (the launcher specializes an argument of 1 to a constant; the
    # counts of rows and spans it does not)
    vec, lrows, tps, warps = _triton.geometry("bfloat16")
    for cons in (dict(HAS_TGT=False, HAS_REF=True, WANT_ENT=False, WANT_AMAX=False, WANT_RANK=False, CAPPED=False),
                 dict(HAS_TGT=False, HAS_REF=False, WANT_ENT=True, WANT_AMAX=True, WANT_RANK=False, CAPPED=True),
                 dict(every, HAS_REF=False, WANT_AMAX=True, n_cols=1)):
        sig = {k: v for k, v in spans_sig.items() if k not in cons}
        got = usage(_triton._spans, sig, dict(VEC=vec, LROWS=lrows, TPS=tps, **cons), warps)[:3]
        assert frame_ok(*got[1:3]), (cons, got)
        mcons = dict(ROWS=16, NS=1 if "n_cols" in cons else 8,
                     **{k: v for k, v in cons.items() if k in ("HAS_TGT", "HAS_REF", "WANT_ENT", "WANT_RANK", "CAPPED",
                                                              "n_cols")})
        msig = {k: v for k, v in merge_sig.items() if k not in mcons}
        assert frame_ok(*usage(_triton._merge, msig, mcons, 4)[1:3])
    # and for sm_80 (A100): the KL pass of each layout, and the merge
    for dt, name in (("*fp32", "float32"), ("*bf16", "bfloat16")):
        vec, lrows, tps, warps = _triton.geometry(name)
        got = usage(_triton._spans, dict(spans_sig, z_ptr=dt, r_ptr=dt),
                    dict(VEC=vec, LROWS=lrows, TPS=tps, **dict(off, **variants[3][1]), HAS_TGT=True), warps,
                    arch=80)[:3]
        print("sm_80", name, got)
        assert frame_ok(*got[1:3]), (name, got)
    assert frame_ok(*usage(_triton._merge, merge_sig, dict(ROWS=16, NS=8, **every), 4, arch=80)[1:3])
    print("GROUP OK")


# ------------------------------------------------------------- the tests

INTERPRETED = ["group_random_values", "group_special_values", "group_errors", "group_gpu_path_edges",
               "group_lazy_logits", "group_split_rows", "group_layouts_and_api", "group_bench_smoke",
               "group_rank_and_top_logprob", "group_one_transfer", "group_targets_stay_on_the_device",
               "group_span_edges", "group_sync_false"]
#: the tests run compiled (triton's compile-only path, its launcher), and their groups
COMPILED = {"test_direct_launch_passes_what_triton_passes": "group_direct_launch",
            "test_direct_launch_picks_the_kernel_triton_picks": "group_direct_launch_probe",
            "test_compiles_for_sm90_without_spills": "group_compile_sm90"}


@pytest.fixture(scope="module")
def groups(request):
    """Every group's process, two at a time in the background (`Jobs`)."""
    jobs = {f"test_interpreted[{g}]": (lambda g=g: _child(g)) for g in INTERPRETED}
    jobs.update({test: (lambda g=g: _child(g, interpret=False)) for test, g in COMPILED.items()})
    pool = Jobs(request, jobs)
    yield pool
    pool.close()


@pytest.mark.parametrize("group", INTERPRETED)
def test_interpreted(group, groups, request):
    _passed(groups.result(request))


def test_direct_launch_passes_what_triton_passes(groups, request):
    _passed(groups.result(request))


def test_direct_launch_picks_the_kernel_triton_picks(groups, request):
    _passed(groups.result(request))


def test_compiles_for_sm90_without_spills(groups, request):
    _passed(groups.result(request))


# ------------------------------------------------- on a GPU, when present

def _cuda_available():
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="CUDA absent")
def test_gpu_kernel_against_the_torch_path_and_the_core(monkeypatch):
    """Compiled kernels on CUDA tensors: the native core's values, the torch
    path's, and bitwise the same results for any number of tiles a program."""
    from lmmetrics import _engine
    from lmmetrics._engine.cuda import triton as _triton

    calls = []
    launch = _triton.compute
    monkeypatch.setattr(_triton, "compute", lambda *a: calls.append(1) or launch(*a))
    for dtype in _dtypes():
        z, r, t = _random((48,), 32000, dtype, seed=21)
        z[3, 5] = math.inf
        z[7, :z.shape[-1] // 4] = -math.inf      # leading all -inf tiles
        z[9, ::3] = -math.inf
        r[11, ::7] = -math.inf
        t[4] = -100
        z[4, 0] = math.nan                        # ignored
        zc, rc, tc = z.cuda(), r.cuda(), t.cuda()
        for cap in (None, 30.0):
            kw = dict(softcap=cap, nll=True, entropy=True, argmax=True, kl=True, ref_nll=True)
            got = _engine.run(zc, tc, rc, **kw)
            core = _engine.run(_np(z), _np(t), _np(r), **kw)
            monkeypatch.setenv("LMMETRICS_TRITON", "0")
            torch_path = _engine.run(zc, tc, rc, **kw)
            monkeypatch.delenv("LMMETRICS_TRITON")
            for k in KEYS:
                a, b, c = getattr(got, k), getattr(core, k), getattr(torch_path, k)
                if "argmax" in k:
                    np.testing.assert_array_equal(a, b, err_msg=k)
                else:
                    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=k)
                    np.testing.assert_allclose(a, c, rtol=TOL, atol=TOL, err_msg=k)
        for per in (1, 3, 16):
            monkeypatch.setattr(_triton, "_per_prog", per)
            again = _engine.run(zc, tc, rc, **kw)
            for k in KEYS:
                np.testing.assert_array_equal(getattr(again, k), getattr(got, k), err_msg=f"{k} {per}")
        monkeypatch.setattr(_triton, "_per_prog", None)
        z[5, 6] = math.nan
        with pytest.raises(ValueError, match=r"NaN in logits at row 5"):
            lmmetrics.cross_entropy(z.cuda(), tc)
    assert len(calls) == 3 * (2 + 3 + 1)


@pytest.mark.skipif(not _cuda_available(), reason="CUDA absent")
def test_gpu_cached_launch_gives_triton_launchers_bits(monkeypatch):
    """Launches past Triton's binder (a specialization's second launch on)
    give the bits of Triton's own launches, over specializations (dtypes,
    logits off 16 bytes, a vocabulary of a multiple of 16, targets at
    stride 1 and 3, shift=True views, one row), and are taken."""
    import torch
    from triton.runtime.jit import JITFunction

    from lmmetrics import _engine
    from lmmetrics._engine.cuda import triton as _triton

    if not _triton._direct:
        pytest.skip(f"launches go through triton's own launcher with this triton ({_triton.triton.__version__})")
    jit_runs = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: jit_runs.append(1) or run(self, *a, **k))
    z, r, t = _random((3, 40), 5000, torch.float32, seed=4)
    zc, rc, tc = z.cuda(), r.cuda(), t.cuda()
    big = torch.randint(0, 5000, (3, 40, 3), generator=torch.Generator().manual_seed(9)).cuda()
    cases = [(zc.bfloat16(), tc, None, dict(shift=True)), (zc[..., 1:].bfloat16(), tc % 4999, None, dict(shift=True)),
             (zc[..., :4992], tc % 4992, rc[..., :4992].half(), dict(shift=False, kl=True, ref_nll=True)),
             (zc[0], big[0, :, 0], None, dict(shift=False, rank=True)), (zc[:1, :2], tc[:1, :2], None, dict(shift=True)),
             (zc.half(), tc, None, dict(shift=True, softcap=20.0))]
    for i, (logits, targets, ref, kw) in enumerate(cases):
        kw = dict(kw, nll=True, entropy=True, argmax=True)
        monkeypatch.setattr(_triton, "_direct", False)
        want = _engine.run(logits, targets, ref, **kw)
        monkeypatch.setattr(_triton, "_direct", True)
        _engine.run(logits, targets, ref, **kw)
        jit_runs.clear()
        got = _engine.run(logits, targets, ref, **kw)
        assert not jit_runs, i
        for k in KEYS + ("rank",):
            if getattr(want, k, None) is not None:
                np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=f"case {i}: {k}")
        assert got.nll_sum == want.nll_sum


@pytest.mark.skipif(not _cuda_available(), reason="CUDA absent")
def test_gpu_rows_past_2_31_elements():
    """int64 offsets: rows whose elements lie beyond 2^31 (4.3 GB of bfloat16)."""
    import torch

    V = 128256
    N = 2**31 // V + 8
    if torch.cuda.get_device_properties(0).total_memory < 3 * N * V * 2:
        pytest.skip("not enough GPU memory")
    z = torch.empty(N, V, dtype=torch.bfloat16, device="cuda")
    for i in range(0, N, 1024):
        z[i:i + 1024].normal_(0.0, 3.0)
    t = torch.randint(0, V, (N,), device="cuda")
    nll = lmmetrics.token_nll(z, t)
    tail = z[-16:].cpu()
    np.testing.assert_allclose(nll[-16:].cpu().numpy(), ref_nll(tail.double().numpy(), t[-16:].cpu().numpy()),
                               rtol=TOL, atol=TOL)
    assert lmmetrics.token_entropy(z)[-1].item() == pytest.approx(ref_entropy(tail[-1:].double().numpy())[0],
                                                                   abs=TOL)


@pytest.mark.skipif(not _cuda_available(), reason="CUDA absent")
def test_gpu_path_edges_on_a_gpu():
    """The rows where a CUDA path once gave wrong numbers, through the
    compiled kernel (the torch path's run is in test_cuda_path)."""
    from helpers import check_gpu_path_edges

    check_gpu_path_edges("cuda")
