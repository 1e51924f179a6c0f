"""The fast paths of the last kernel change, each against an independent
answer: C-contiguous numpy logits described without the generic path
(_inputs.as_logits's first branch, _core.address) and the benchmarks' read
pass over each SIMD path (_core.read_pass with isa= and prefetch=)."""
import ctypes

import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from lmmetrics._engine import inputs as _inputs
from helpers import BF16, DTYPES, ISAS, is_bf16

FIELDS = ("ptr", "dtype", "lead_shape", "n_cols", "n_rows", "rows_inner", "row_stride", "outer_stride")
SHAPES = [(5,), (1,), (1, 5), (3, 5), (2, 3, 5), (1, 1, 5), (4, 1, 7), (1, 1), (2, 1), (7, 1, 1),
          (2, 3, 4, 5), (1, 3, 1, 6)]


def fields(d):
    return {f: getattr(d, f) for f in FIELDS}


def addr(a):
    return a.__array_interface__["data"][0]


def name_of(dt):
    return "bfloat16" if is_bf16(dt) else np.dtype(dt).name


def generic(a, name=None):
    """The generic path's descriptor of `a` (native, last axis contiguous and
    leading strides whole elements: described in place, no copy)."""
    name = name or name_of(a.dtype)
    strides = tuple(s // a.itemsize for s in a.strides[:-1])
    return fields(_inputs._describe(a, addr(a), name, a.shape, strides, False, "logits"))


def values(shape, dt, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(dt)


@pytest.fixture
def fresh_names(monkeypatch):
    """_inputs._NAMES as it is at import (bfloat16 not yet seen), restored
    afterwards: what a test caches there does not reach the others."""
    names = {dt: n for dt, n in _inputs._NAMES.items() if n != "bfloat16"}
    monkeypatch.setattr(_inputs, "_NAMES", names)
    return names


# -- 1. the descriptor of C-contiguous arrays ---------------------------------

# independent of both paths: rows of n_cols values, one stride (n_cols) when
# there is more than one row
BY_HAND = {(5,): ((), 5, 1, 1, 0, 0), (1,): ((), 1, 1, 1, 0, 0), (1, 5): ((1,), 5, 1, 1, 0, 0),
           (3, 5): ((3,), 5, 3, 3, 5, 0), (2, 3, 5): ((2, 3), 5, 6, 6, 5, 0),
           (1, 1, 5): ((1, 1), 5, 1, 1, 0, 0), (4, 1, 7): ((4, 1), 7, 4, 4, 7, 0),
           (1, 1): ((1,), 1, 1, 1, 0, 0), (2, 1): ((2,), 1, 2, 2, 1, 0),
           (7, 1, 1): ((7, 1), 1, 7, 7, 1, 0), (2, 3, 4, 5): ((2, 3, 4), 5, 24, 24, 5, 0),
           (1, 3, 1, 6): ((1, 3, 1), 6, 3, 3, 6, 0)}


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_contiguous_descriptor_is_the_generic_one(dt, shape, readonly):
    a = values(shape, dt)
    if readonly:
        a.setflags(write=False)
    assert _core.address(a) == addr(a)
    want = generic(a)
    assert want["ptr"] == addr(a) and want["dtype"] == name_of(dt)
    assert tuple(want[f] for f in FIELDS[2:]) == BY_HAND[shape]
    for _ in range(2):  # bfloat16: the first call may cache its dtype, the second is the fast path
        d = _inputs.as_logits(a)
        assert fields(d) == want
        assert d.keep is a and type(d.lead_shape) is tuple
        assert all(type(n) is int for n in d.lead_shape + (d.n_cols, d.n_rows, d.rows_inner))


@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_contiguous_arrays_skip_the_generic_path(dt, monkeypatch):
    """Once the dtype is known (bfloat16 after its first call) a C-contiguous
    native array is described without _dtype_name / _describe."""
    a = values((3, 4, 9), dt)
    want = generic(a)
    _inputs.as_logits(a)

    def boom(*args, **kwargs):
        raise AssertionError("the generic path ran")

    monkeypatch.setattr(_inputs, "_describe", boom)
    monkeypatch.setattr(_inputs, "_dtype_name", boom)
    for shape in [(3, 4, 9), (12, 9), (108,), (1, 1, 108), (108, 1)]:
        b = a.reshape(shape)
        assert fields(_inputs.as_logits(b)) == generic_fields_without_describe(b)
    assert fields(_inputs.as_logits(a)) == want


def generic_fields_without_describe(a):
    """The same answer as generic() for a C-contiguous array, by hand."""
    n_rows = a.size // a.shape[-1]
    return {"ptr": addr(a), "dtype": name_of(a.dtype), "lead_shape": a.shape[:-1], "n_cols": a.shape[-1],
            "n_rows": n_rows, "rows_inner": n_rows, "row_stride": a.shape[-1] if n_rows > 1 else 0,
            "outer_stride": 0}


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
def test_bfloat16_generic_first_then_fast(fresh_names, monkeypatch):
    a = values((3, 5), BF16)
    want = generic(a)
    calls = []
    real = _inputs._describe
    monkeypatch.setattr(_inputs, "_describe", lambda *args: calls.append(1) or real(*args))
    assert fields(_inputs.as_logits(a)) == want and len(calls) == 1  # not yet seen: the generic path
    assert fresh_names.get(BF16) == "bfloat16"
    assert fields(_inputs.as_logits(a)) == want and len(calls) == 1  # seen: the fast path


@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_address_of_views_and_offsets(dt):
    base = values((6, 8), dt)
    item = base.itemsize
    for a, first in [(base[2:], 16), (base[3], 24), (base[5:6], 40), (base[1, 3:], 11),
                     (base.reshape(-1)[7:30], 7), (base[4:, None], 32)]:
        assert a.flags.c_contiguous
        assert _core.address(a) == addr(a) == addr(base) + first * item
        assert fields(_inputs.as_logits(a)) == generic(a)


def test_address_of_other_buffers_and_refusals():
    b = bytearray(b"0123456789")
    assert _core.address(b) == ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))
    assert _core.address(memoryview(b)[3:]) == _core.address(b) + 3
    for not_c in [np.zeros((3, 4))[:, ::2], np.zeros((3, 4)).T]:
        with pytest.raises(ValueError, match="not C-contiguous"):
            _core.address(not_c)
    for not_a_buffer in [5, "abc", None]:
        with pytest.raises(TypeError):
            _core.address(not_a_buffer)


# -- 2. what the fast path leaves to the generic one --------------------------

@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_empty_and_scalar_logits(dt):
    for shape in [(0, 5), (2, 0, 5), (0, 1)]:
        a = np.zeros(shape, dt)
        d = _inputs.as_logits(a)
        assert fields(d) == generic(a) and d.n_rows == 0 and d.n_cols == shape[-1]
    for shape in [(3, 0), (0,), (0, 0), (2, 3, 0)]:
        with pytest.raises(ValueError, match="empty vocabulary"):
            _inputs.as_logits(np.zeros(shape, dt))
    for a in [np.zeros((), dt), np.asarray(values((1,), dt)[0])]:
        assert a.ndim == 0
        with pytest.raises(ValueError, match="at least one axis"):
            _inputs.as_logits(a)


OTHER_DTYPES = [np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.longdouble, ">i4", object, "U3",
                [("a", "<f4")]]
if BF16 is not None:  # ml_dtypes' other small floats are not bfloat16
    import ml_dtypes

    OTHER_DTYPES += [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("dt", OTHER_DTYPES, ids=str)
def test_other_dtypes_are_a_type_error(dt):
    for shape in [(3, 5), (5,), ()]:
        a = np.zeros(shape, dt)
        with pytest.raises(TypeError, match="must be float32"):
            _inputs.as_logits(a)
        with pytest.raises(TypeError):
            lmmetrics.cross_entropy(a, np.zeros(shape[:-1], np.int64))


def strided_views(dt):
    """Views that keep the last axis contiguous: described in place."""
    a = values((4, 6, 10), dt)
    return [a[::2], a[:, 1:], a[::-1], a[:, ::-2], a[1:3, 2:5], a[:, :, :7], a[:, 0], a[..., 3:]]


def copied_views(dt):
    """Views the generic path copies (last axis not contiguous)."""
    a = values((4, 6, 10), dt)
    return [a.T, a.transpose(0, 2, 1), a[..., ::-1], a[..., ::2], np.asfortranarray(a[0]), a[0].T,
            np.swapaxes(a, 0, 1)[:, :, ::3]]


@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_strided_views_described_in_place(dt):
    for v in strided_views(dt):
        assert not v.flags.c_contiguous
        d = _inputs.as_logits(v)
        assert fields(d) == generic(v) and d.keep is v and d.ptr == addr(v)


def assert_a_native_copy(d, v):
    keep = d.keep
    assert keep is not v and keep.flags.c_contiguous and keep.dtype.isnative
    assert d.ptr == addr(keep) == _core.address(keep) and d.ptr != addr(v)
    assert np.array_equal(keep.astype(np.float64), v.astype(np.float64))
    assert fields(d) == generic(keep, name_of(keep.dtype))


@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_non_contiguous_views_are_copied(dt):
    for v in copied_views(dt):
        assert not v.flags.c_contiguous
        assert_a_native_copy(_inputs.as_logits(v), v)


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 5), (7,), (1, 1)], ids=str)
@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16], ids=name_of)
def test_big_endian_is_a_native_copy(dt, shape):
    a = values(shape, dt)
    be = a.astype(np.dtype(dt).newbyteorder(">"))
    assert be.flags.c_contiguous and not be.dtype.isnative
    for _ in range(2):  # nothing cached by the first call turns the second into the fast path
        d = _inputs.as_logits(be)
        assert_a_native_copy(d, be)
        assert d.dtype == name_of(dt) and fields(d) == dict(generic(a), ptr=d.ptr)


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
def test_big_endian_bfloat16_is_a_native_copy_every_time(fresh_names):
    a = values((3, 5), BF16)
    be = a.astype(BF16.newbyteorder(">"))
    assert not be.dtype.isnative and np.array_equal(be.astype(np.float32), a.astype(np.float32))
    t = np.array([0, 4, 2])
    want = lmmetrics.cross_entropy(a, t, reduction="none")
    # every call takes the generic path's byte-swapped copy: the dtype
    # cache holds native dtypes only (a cached big-endian bfloat16 once
    # sent the second call down the fast path, reading swapped bytes)
    for _ in range(3):
        assert lmmetrics.cross_entropy(be, t, reduction="none").tobytes() == want.tobytes()
    assert_a_native_copy(_inputs.as_logits(be), be)


class Sub(np.ndarray):
    pass


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_subclasses_and_array_likes(dt):
    a = values((3, 5), dt)
    for s in [a.view(Sub), a.view(Sub)[None], np.asmatrix(a)]:
        assert type(s) is not np.ndarray and s.flags.c_contiguous
        d = _inputs.as_logits(s)
        assert fields(d) == generic(s) and d.ptr == addr(a)
    ro = a.view(Sub)
    ro.setflags(write=False)
    assert fields(_inputs.as_logits(ro)) == generic(ro)
    d = _inputs.as_logits(a.tolist())  # a list: np.asarray's float64
    assert d.dtype == "float64" and (d.n_rows, d.n_cols) == (3, 5)
    assert np.array_equal(d.keep, a.astype(np.float64))


@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_size_one_axis_with_odd_stride(dt):
    """A C-contiguous array whose size-1 axis has a stride that is not a whole
    number of elements (a field of a packed record): read in place where its
    address is aligned (16-bit fields here), else from an aligned copy (the
    core reads whole elements); the same numbers as from a contiguous copy."""
    item = np.dtype(dt).itemsize
    rec = np.zeros(2, [("pad", "u1"), ("z", dt, (9,))])
    rec["z"] = values((2, 9), dt)
    v = rec["z"][1:2]
    assert v.flags.c_contiguous and v.strides[0] % item
    assert v.flags.aligned == (item == 2)  # the row starts at byte 20
    d = _inputs.as_logits(v)
    assert (d.keep is v) == v.flags.aligned and d.keep.flags.aligned and d.ptr % item == 0
    assert np.array_equal(d.keep.view(np.uint8), np.ascontiguousarray(v).view(np.uint8))
    assert {f: w for f, w in fields(d).items() if f != "ptr"} == \
        {f: w for f, w in generic(np.ascontiguousarray(v)).items() if f != "ptr"}
    c = np.ascontiguousarray(v)
    t = np.array([4])
    assert lmmetrics.cross_entropy(v, t, reduction="none").tobytes() == \
        lmmetrics.cross_entropy(c, t, reduction="none").tobytes()
    assert lmmetrics.token_entropy(v).tobytes() == lmmetrics.token_entropy(c).tobytes()


@pytest.mark.parametrize("dt", ["float32", "float64", "float16"])
def test_unaligned_buffer_is_copied(dt):
    """Logits at an address that is not a multiple of their element size
    (np.frombuffer at an odd offset): read from an aligned copy, the same
    numbers as the aligned array."""
    a = values((3, 11), dt)
    raw = np.zeros(a.nbytes + 1, np.uint8)
    raw[1:] = a.view(np.uint8).reshape(-1)
    u = np.frombuffer(raw.data, dtype=dt, offset=1).reshape(a.shape)
    assert not u.flags.aligned and u.flags.c_contiguous and np.array_equal(u, a)
    d = _inputs.as_logits(u)
    assert d.keep.flags.aligned and d.ptr % a.itemsize == 0
    t = np.array([1, 5, 10])
    assert lmmetrics.cross_entropy(u, t, reduction="none").tobytes() == \
        lmmetrics.cross_entropy(a, t, reduction="none").tobytes()
    torch = pytest.importorskip("torch")
    # a torch tensor there (torch.frombuffer at an odd offset) too: the core
    # read it in place, a misaligned element access
    ut = torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, dt), offset=1).view(a.shape)
    assert ut.data_ptr() % a.itemsize and np.array_equal(ut.numpy(), a)
    d = _inputs.as_logits(ut)
    assert d.ptr % a.itemsize == 0
    assert lmmetrics.token_entropy(ut).numpy().tobytes() == lmmetrics.token_entropy(a).tobytes()
    assert lmmetrics.cross_entropy(ut, torch.from_numpy(t), reduction="none").numpy().tobytes() == \
        lmmetrics.cross_entropy(a, t, reduction="none").tobytes()


# -- 3. the same numbers from the fast path and a strided copy ----------------

def non_contiguous_same_values(a):
    """The values of `a` in buffers that are not C-contiguous: a Fortran
    copy (2-D), a view with a leading stride (described in place) and a
    view with a strided vocabulary axis (copied by the generic path)."""
    out = []
    if a.ndim == 2 and a.shape[0] > 1 and a.shape[1] > 1:
        out.append(np.asfortranarray(a))
    if a.size // a.shape[-1] > 1:
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 3,), a.dtype)
        wide[..., 3:3 + a.shape[-1]] = a
        out.append(wide[..., 3:3 + a.shape[-1]])
    every_other = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    every_other[..., 1::2] = a
    out.append(every_other[..., 1::2])
    for v in out:
        assert not v.flags.c_contiguous and np.array_equal(v.astype(np.float64), a.astype(np.float64))
    return out


@pytest.mark.parametrize("shape", [(6, 37), (2, 3, 129), (1, 1000), (5, 1), (4, 1, 33), (300,)], ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=name_of)
def test_metrics_equal_on_a_non_contiguous_copy(isa, dt, shape):
    a = values(shape, dt, seed=sum(shape))
    assert a.flags.c_contiguous
    r = values(shape, dt, seed=1 + sum(shape))
    t = np.random.default_rng(2).integers(0, shape[-1], shape[:-1])
    fns = [lambda z, ref: lmmetrics.cross_entropy(z, t, reduction="none"),
           lambda z, ref: lmmetrics.token_nll(z, t, softcap=5.0),
           lambda z, ref: lmmetrics.token_entropy(z),
           lambda z, ref: lmmetrics.kl_divergence(z, reference_logits=ref, reduction="none")]
    wants = [np.asarray(fn(a, r)) for fn in fns]
    assert all(np.isfinite(w).all() and w.shape == shape[:-1] for w in wants)
    m = lmmetrics.evaluate(a, t, reference_logits=r)
    for b, rb in zip(non_contiguous_same_values(a), non_contiguous_same_values(r)):
        for fn, want in zip(fns, wants):
            assert np.asarray(fn(b, rb)).tobytes() == want.tobytes()
            assert np.asarray(fn(b, r)).tobytes() == want.tobytes()
            assert np.asarray(fn(a, rb)).tobytes() == want.tobytes()
        mb = lmmetrics.evaluate(b, t, reference_logits=rb)
        assert (m.nll_sum, m.accuracy, m.entropy, m.kl, m.same_top) == \
            (mb.nll_sum, mb.accuracy, mb.entropy, mb.kl, mb.same_top)


# -- 4. the read pass ----------------------------------------------------------

CHUNK = 65536  # bytes: lm_read_pass reads whole 64 KB chunks with the SIMD loop, ORs the rest


def read_pass_answer(buf, nbytes):
    """The float32 bits of the max over the whole chunks (-inf with none)
    ORed with every byte after them."""
    whole = nbytes // CHUNK * CHUNK
    m = buf[:whole].view(np.float32).max() if whole else np.float32(-np.inf)
    tail = np.bitwise_or.reduce(buf[whole:nbytes]) if nbytes > whole else 0
    return int(np.float32(m).view(np.uint32)) | int(tail)


def read_buffer(nbytes, seed, where=None, negative=False):
    """nbytes (whole floats and an odd tail) of random normal floats; the max
    (10.5) planted at float index `where`."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((nbytes + 3) // 4).astype(np.float32)
    if negative:
        f = -np.abs(f) - 1.0
    if where is not None:
        f[where] = 10.5
    return f.view(np.uint8)[:nbytes].copy()


READ_CASES = [
    (0, None), (1, None), (3, None), (100, None), (CHUNK - 1, None),  # no whole chunk
    (CHUNK, None), (CHUNK, CHUNK // 4 - 1), (CHUNK + 1, 0), (CHUNK + 5, None),
    (3 * CHUNK + 7, 2 * CHUNK // 4 + 5), (5 * CHUNK + CHUNK - 1, 4 * CHUNK // 4 + 777),
    (17 * CHUNK, 17 * CHUNK // 4 - 1), (17 * CHUNK + 4093, 9 * CHUNK // 4 + 128), (64 * CHUNK + 10, None),
]


@pytest.mark.parametrize("negative", [False, True], ids=["mixed", "negative"])
@pytest.mark.parametrize("nbytes,where", READ_CASES, ids=[f"{n}B" for n, _ in READ_CASES])
def test_read_pass_same_on_every_path(nbytes, where, negative):
    buf = read_buffer(nbytes, nbytes, where, negative)
    want = read_pass_answer(buf, nbytes)
    ptr = addr(buf)
    got = {(isa, pf, nt): _core.read_pass(ptr, nbytes, nt, isa, pf)
           for isa in ISAS + [None] for pf in (False, True) for nt in (1, 2)}
    assert ISAS and set(got.values()) == {want}, got
    assert _core.read_pass(ptr, nbytes) == want
    if nbytes > 4 * CHUNK:  # an offset start: unaligned SIMD loads
        off = buf[4:]
        want_off = read_pass_answer(off, nbytes - 4)
        assert {_core.read_pass(addr(off), nbytes - 4, nt, isa, pf)
                for isa in ISAS for pf in (False, True) for nt in (1, 2)} == {want_off}


def test_read_pass_depends_on_the_max_and_the_tail():
    buf = read_buffer(2 * CHUNK + 3, 5)
    buf[-3:] = 0
    base = read_pass_answer(buf, buf.size)
    assert base == int(buf[:2 * CHUNK].view(np.float32).max().view(np.uint32))
    bigger = buf.copy()
    bigger[CHUNK + 8:CHUNK + 12] = np.frombuffer(np.float32(99.0).tobytes(), np.uint8)
    tailed = buf.copy()
    tailed[-1] = 0x81
    for isa in ISAS:
        for pf in (False, True):
            assert _core.read_pass(addr(buf), buf.size, 2, isa, pf) == base
            assert _core.read_pass(addr(bigger), bigger.size, 2, isa, pf) == int(np.float32(99.0).view(np.uint32))
            assert _core.read_pass(addr(tailed), tailed.size, 2, isa, pf) == base | 0x81


def test_read_pass_refuses_unknown_and_unsupported_paths():
    buf = read_buffer(CHUNK + 1, 1)
    for bad in ["", "sse2", "AVX2", "avx-512", "none", "auto"]:
        with pytest.raises(ValueError, match="not available"):
            _core.read_pass(addr(buf), buf.size, 1, bad)
    missing = [i for i in _core.ISAS if not _core.isa_supported(i)]
    for bad in missing:
        for pf in (False, True):
            with pytest.raises(ValueError, match="not available"):
                _core.read_pass(addr(buf), buf.size, 1, bad, pf)
    assert missing  # x86 has no neon, ARM no avx2 / avx512


# -- _core.run's targets and outputs: plain buffer requests -----------------

def _run_rows(z, targets, outputs):
    return _core.run(dtype=_core.DTYPES["float32"], n_rows=z.shape[0], n_cols=z.shape[1],
                     rows_inner=z.shape[0], logits=(addr(z), z.shape[1], z.shape[1]),
                     targets=targets, outputs=outputs)


def test_core_run_fills_the_outputs_it_is_given():
    rng = np.random.default_rng(4)
    z = rng.standard_normal((3, 40)).astype(np.float32)
    t = np.array([0, 39, 7], np.int64)
    zz = z.astype(np.float64)
    lse = np.log(np.exp(zz).sum(1))
    p = np.exp(zz - lse[:, None])
    nll, ent, amax = np.full(3, -1.0), np.full(3, -1.0), np.full(3, -7, np.int64)
    readonly_t = t.copy()
    readonly_t.flags.writeable = False  # targets are only read
    status, bad, total, counted = _run_rows(z, readonly_t, (nll, ent, amax))
    assert (status, bad, counted) == (0, -1, 3)
    np.testing.assert_allclose(nll, lse - zz[np.arange(3), t], atol=2e-6)
    np.testing.assert_allclose(ent, -(p * np.log(p)).sum(1), atol=2e-6)
    np.testing.assert_array_equal(amax, zz.argmax(1))
    assert total == pytest.approx((lse - zz[np.arange(3), t]).sum(), rel=1e-7)
    # fewer outputs than six: the rest are None; none at all: only the count
    nll2 = np.empty(3)
    assert _run_rows(z, t, (nll2,))[0] == 0 and np.array_equal(nll2, nll)
    assert _run_rows(z, t, ())[1:] == (-1, 0.0, 3)


@pytest.mark.parametrize("targets,outputs,err,needle", [
    (np.array([1, 2, 3], np.int32), (), ValueError, "targets must be a 1-D C-contiguous aligned native int64"),
    (np.frombuffer(b"x" + np.arange(3, dtype=np.int64).tobytes(), np.int64, offset=1), (), ValueError,
     "targets must be"),
    (np.arange(3, dtype=np.int64).astype(np.dtype(np.int64).newbyteorder()), (), ValueError, "targets must be"),
    (memoryview(bytearray(25))[1:].cast("q"), (), ValueError, "targets must be"),  # at an odd address
    (np.array([1, 2, 3, 4], np.int64), (), ValueError, "targets holds 4 values for 3 rows"),
    (np.array([1, 2, 3], np.int64), (np.empty(4),), ValueError, "nll holds 4 values for 3 rows"),
    (np.array([1, 2, 3], np.int64), (np.empty(3, np.float32),), ValueError, "nll must be a 1-D C-contiguous aligned native float64"),
    (np.array([1, 2, 3], np.int64), (None, None, np.empty(3)), ValueError, "argmax must be a 1-D C-contiguous aligned native int64"),
    (np.array([1, 2, 3], np.int64), (None, np.empty((3, 1))), ValueError, "entropy must be a 1-D"),
    (np.array([1, 2, 3], np.int64), (None, np.empty((3, 2))[:, 0]), ValueError, "contiguous"),
    (np.array([1, 2, 3], np.int64), (None,) * 9, ValueError, "outputs holds 9 arrays, at most 8"),
])
def test_core_run_refuses_what_is_not_one_value_a_row(targets, outputs, err, needle):
    z = np.zeros((3, 8), np.float32)
    with pytest.raises(err, match=needle):
        _run_rows(z, targets, outputs)


def test_core_run_refuses_a_read_only_output_and_releases_what_it_held():
    z = np.zeros((3, 8), np.float32)
    # memoryviews over bytearrays: release() fails while a buffer is held
    t = memoryview(bytearray(np.array([1, 2, 3], np.int64).tobytes())).cast("q")
    nll = memoryview(bytearray(24)).cast("d")
    ro = np.empty(3)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="read-only"):
        _run_rows(z, t, (nll, ro))
    assert _run_rows(z, t, (nll,))[0] == 0
    assert list(nll) == pytest.approx([np.log(8)] * 3, rel=1e-7)
    t.release()  # BufferError if run still held them
    nll.release()


def test_unaligned_targets_are_copied_aligned():
    # int64 targets at an odd offset (a memory-mapped tensor, a packed
    # buffer): read through an aligned copy, the same numbers
    rng = np.random.default_rng(6)
    z = rng.standard_normal((4, 30)).astype(np.float32)
    t = rng.integers(0, 30, 4).astype(np.int64)
    odd = np.frombuffer(b"x" + t.tobytes(), np.int64, offset=1)
    assert not odd.flags.aligned and _inputs.as_targets(odd, _inputs.as_logits(z), check_range=False).flags.aligned
    zz = z.astype(np.float64)
    want = np.log(np.exp(zz).sum(1)) - zz[np.arange(4), t]
    for check in (False, True):
        got = _inputs.as_targets(odd, _inputs.as_logits(z), check_range=check)
        assert got.flags.aligned and np.array_equal(got, t)
    np.testing.assert_allclose(lmmetrics.token_nll(z, odd), want, atol=2e-6)


@pytest.mark.parametrize("logits,reference", [((0, 1), None), ((0, 1, 1, 1), None), ((0, 1, 1), (0,))])
def test_core_run_refuses_a_malformed_buffer_tuple(logits, reference):
    with pytest.raises(ValueError, match="must be \\(address, row stride, outer stride\\)"):
        _core.run(dtype=0, n_rows=1, n_cols=1, rows_inner=1, logits=logits, reference=reference)
