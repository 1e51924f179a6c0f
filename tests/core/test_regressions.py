"""Inputs that once gave a wrong number, a traceback or a hang: each case
against an independent float64 computation (or the documented exception)."""
import _thread
import math
import threading
import time

import numpy as np
import pytest

import lmmetrics
from helpers import BF16, log_softmax, logsumexp, ref_entropy, ref_kl

F32_MIN = float(np.finfo(np.float32).min)


def capped_reference(z, c):
    """float64 NLL-ready logits after the softcap c tanh(z / c)."""
    return c * np.tanh(np.asarray(z).astype(np.float64) / c)


# -- 1. softcap: the tail padding adds nothing -------------------------------

@pytest.mark.parametrize("v", [1, 2, 3, 15, 17, 31, 33, 1000, 50001])
@pytest.mark.parametrize("c", [1.0, 30.0])
def test_softcap_when_v_is_not_a_multiple_of_the_vector_step(isa, v, c):
    rng = np.random.default_rng(v)
    z = (rng.standard_normal((3, v)) * 4).astype(np.float32)
    t = np.array([0, v - 1, v // 2])
    zc = capped_reference(z, c)
    want_nll = logsumexp(zc, axis=1) - zc[np.arange(3), t]
    np.testing.assert_allclose(lmmetrics.token_nll(z, t, softcap=c), want_nll, atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(lmmetrics.token_entropy(z, softcap=c), ref_entropy(zc), atol=2e-6, rtol=1e-6)
    m = lmmetrics.evaluate(z, t, softcap=c, reference_logits=z[::-1].copy())
    assert m.accuracy == np.mean(zc.argmax(1) == t)
    assert abs(m.kl - ref_kl(zc[::-1], zc).mean()) < 2e-6


def test_softcap_of_a_single_entry_row_is_certain():
    assert lmmetrics.token_nll(np.array([[5.0]], np.float32), np.array([0]), softcap=1.0)[0] == 0.0


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softcap_tail_16_bit(isa, dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    z = (np.random.default_rng(3).standard_normal((2, 45)) * 5).astype(dt)
    t = np.array([3, 44])
    zc = capped_reference(z, 2.0)
    np.testing.assert_allclose(lmmetrics.token_nll(z, t, softcap=2.0),
                               logsumexp(zc, axis=1) - zc[[0, 1], t], atol=2e-6, rtol=1e-6)


# -- 2. KL with finite masks ---------------------------------------------------

@pytest.mark.parametrize("mask", [F32_MIN, -1e30])
def test_kl_with_the_same_finite_mask_in_both(isa, mask):
    rng = np.random.default_rng(1)
    r = rng.standard_normal((4, 1000)).astype(np.float32)
    z = (r + 0.1 * rng.standard_normal(r.shape)).astype(np.float32)
    r[:, 500:] = mask
    z[:, 500:] = mask
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r), ref_kl(r, z), atol=2e-6)
    assert np.abs(lmmetrics.token_kl(z, reference_logits=z)).max() < 2e-6
    assert abs(lmmetrics.kl_divergence(z, reference_logits=r) - ref_kl(r, z).mean()) < 2e-6


def test_kl_where_only_one_side_masks(isa):
    rng = np.random.default_rng(2)
    r = rng.standard_normal((3, 300)).astype(np.float32)
    z = rng.standard_normal((3, 300)).astype(np.float32)
    z1 = z.copy()
    z1[:, 7] = F32_MIN           # the model masks a token the reference does not: KL ~ 1e38
    np.testing.assert_allclose(lmmetrics.token_kl(z1, reference_logits=r), ref_kl(r, z1), rtol=1e-6)
    r1 = r.copy()
    r1[:, 7] = F32_MIN           # the reference masks: that token adds nothing
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r1), ref_kl(r1, z), atol=2e-6)
    r2, z2 = r.copy(), z.copy()  # a reference entry below the float range against a mask
    r2[:, 9] = r2.max(1) - 95.0
    z2[:, 9] = F32_MIN
    np.testing.assert_allclose(lmmetrics.token_kl(z2, reference_logits=r2), ref_kl(r2, z2), rtol=1e-6, atol=2e-6)
    z3 = z.copy()                # the model rules out (-inf) what the reference allows: inf
    z3[:, 4] = -np.inf
    assert np.isinf(lmmetrics.token_kl(z3, reference_logits=r)).all()


# -- 3, 4. huge maxima ---------------------------------------------------------

@pytest.mark.parametrize("big", [1e15, 1e17, 1e19, 1e300])
def test_float64_huge_max(isa, big):
    z = np.array([[big] + [0.0] * 7, [big, big, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    t = np.array([0, 1])
    np.testing.assert_allclose(lmmetrics.token_nll(z, t), [0.0, math.log(2)], atol=1e-12)
    np.testing.assert_allclose(lmmetrics.token_entropy(z), [0.0, math.log(2)], atol=1e-12)
    assert np.abs(lmmetrics.token_kl(z, reference_logits=z)).max() < 1e-12


@pytest.mark.parametrize("big", [1e15, 1e17, 3e38])
def test_exact_path_keeps_z_minus_max(isa, big):
    z = np.array([[big, big, big, 0.0]], np.float32)
    assert abs(lmmetrics.token_nll(z, np.array([0]))[0] - math.log(3)) < 1e-6
    assert lmmetrics.token_nll(z, np.array([3]))[0] == pytest.approx(float(np.float32(big)), rel=1e-6)
    assert abs(lmmetrics.token_entropy(z)[0] - math.log(3)) < 1e-6


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
def test_bfloat16_near_its_max(isa):
    z = np.array([[3e38, 3e38, 0.0]]).astype(BF16)
    assert abs(lmmetrics.token_nll(z, np.array([0]))[0] - math.log(2)) < 1e-6


# -- 5. byte order -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2"])
def test_big_endian_logits_are_read_as_their_values(dtype):
    z = (np.random.default_rng(4).standard_normal((5, 77)) * 3).astype(dtype)
    t = np.arange(5)
    native = z.astype(z.dtype.newbyteorder("="))
    np.testing.assert_array_equal(lmmetrics.token_nll(z, t), lmmetrics.token_nll(native, t))
    want = logsumexp(native.astype(np.float64), axis=1) - native.astype(np.float64)[t, t]
    np.testing.assert_allclose(lmmetrics.token_nll(z, t), want, atol=2e-6, rtol=1e-6)
    np.testing.assert_array_equal(lmmetrics.token_nll(native, t.astype(">i8")), lmmetrics.token_nll(native, t))


# -- 6. unsigned targets and tables -------------------------------------------

def test_uint64_targets_beyond_int64_raise():
    z = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        lmmetrics.token_nll(z, np.array([1, 2**63], np.uint64))
    with pytest.raises(ValueError, match="out of range"):
        lmmetrics.token_nll(z, np.array([1, 2**64 - 1], np.uint64))
    assert lmmetrics.cross_entropy(z, np.array([1, 3], np.uint64)) == pytest.approx(math.log(4))


def test_token_bytes_beyond_int64_raise():
    z = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="token_bytes"):
        lmmetrics.bits_per_byte(z, np.array([1, 2]), np.array([1, 2**63, 1, 1], np.uint64))


# -- 7. perplexity overflows to inf, everything else still comes back --------

def test_perplexity_of_a_huge_loss_is_inf():
    z = np.array([[0.0, 800.0], [0.0, 900.0]], np.float32)
    t = np.array([0, 0])
    assert lmmetrics.perplexity(z, t) == math.inf
    m = lmmetrics.evaluate(z, t)
    assert m.perplexity == math.inf and m.loss == pytest.approx(850.0)
    ev = lmmetrics.Evaluator()
    ev.update(z, t)
    assert ev.compute().perplexity == math.inf
    assert lmmetrics.convert.perplexity_from_bpc(2000.0, 1, 1) == math.inf


# -- 8, 11. arguments the kernel cannot represent -----------------------------

@pytest.mark.parametrize("softcap", [3.4e38, 1e39, 1e-40, 0.0, -1.0, float("nan"), float("inf")])
def test_softcap_out_of_range(softcap):
    with pytest.raises(ValueError, match="softcap"):
        lmmetrics.token_nll(np.zeros((1, 4), np.float32), np.array([0]), softcap=softcap)


@pytest.mark.parametrize("softcap", ["30", b"30", [30.0], True])
def test_softcap_must_be_a_number(softcap):
    with pytest.raises(TypeError, match="softcap"):
        lmmetrics.token_nll(np.zeros((1, 4), np.float32), np.array([0]), softcap=softcap)
    with pytest.raises(TypeError, match="softcap"):
        lmmetrics.Evaluator(softcap=softcap)


def test_softcap_at_the_edge_of_its_range(isa):
    z = (np.random.default_rng(5).standard_normal((2, 50)) * 3).astype(np.float32)
    t = np.array([1, 2])
    for c in (1e30, 1e-30):
        zc = capped_reference(z, c)
        np.testing.assert_allclose(lmmetrics.token_nll(z, t, softcap=c),
                                   logsumexp(zc, axis=1) - zc[[0, 1], t], atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(ignore_index=2**70), dict(ignore_index=-(2**63) - 1),
                                    dict(num_threads=2**31), dict(num_threads=0), dict(num_threads=10**6)])
def test_integer_arguments_out_of_range_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        lmmetrics.token_nll(np.zeros((1, 4), np.float32), np.array([0]), **kwargs)


@pytest.mark.parametrize("key,value", [("tokens", -5), ("tokens", 2.5), ("tokens", True), ("tokens", "7"),
                                       ("nll_sum", "1.0"), ("nll_sum", float("nan")), ("nll_sum", -1.0),
                                       ("bytes", None), ("correct", 10**6)])
def test_load_state_dict_refuses_bad_values(key, value):
    ev = lmmetrics.Evaluator()
    ev.update(np.zeros((3, 4), np.float32), np.array([0, 1, 2]))
    before = ev.state_dict()
    bad = dict(before, **{key: value})
    with pytest.raises(ValueError, match="Evaluator state"):
        ev.load_state_dict(bad)
    assert ev.state_dict() == before


def test_merge_refuses_a_different_token_bytes_table():
    a = lmmetrics.Evaluator(token_bytes=np.array([1, 2, 3, 4]))
    b = lmmetrics.Evaluator(token_bytes=np.array([1, 2, 3, 5]))
    with pytest.raises(ValueError, match="token_bytes"):
        a.merge(b)
    a.merge(lmmetrics.Evaluator(token_bytes=[1, 2, 3, 4]))  # the same counts in another container


# -- 12. Ctrl-C ------------------------------------------------------------------

def _long_call_inputs():
    z = np.random.default_rng(0).standard_normal((1024, 65536))  # float64: libm exp, 512 MiB
    return z, np.zeros(1024, np.int64)


def test_ctrl_c_stops_a_long_call_promptly_and_leaves_no_partial_state():
    z, t = _long_call_inputs()
    kw = dict(reference_logits=z, softcap=30.0)
    ev = lmmetrics.Evaluator(num_threads=1, softcap=30.0)
    t0 = time.perf_counter()
    ev.update(z[:64], t[:64], reference_logits=kw["reference_logits"][:64])
    small = time.perf_counter() - t0  # 1/16 of the work
    before = ev.state_dict()
    timer = threading.Timer(0.2, _thread.interrupt_main)
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ev.update(z, t, reference_logits=kw["reference_logits"])
            time.sleep(5)  # not reached when the call was interrupted
    finally:
        timer.cancel()
    waited = time.perf_counter() - t0
    assert ev.state_dict() == before
    assert waited < 0.2 + max(0.3, 0.5 * small), (waited, small * 16)


def test_nll_only_evaluator_with_reference_logits():
    """nll_only still gives the KL and the top-1 agreement with a reference."""
    rng = np.random.default_rng(7)
    z = rng.standard_normal((5, 40)).astype(np.float32)
    r = (z + 0.3 * rng.standard_normal(z.shape)).astype(np.float32)
    t = np.array([1, 2, -100, 3, 39])
    ev = lmmetrics.Evaluator(nll_only=True)
    ev.update(z, t, reference_logits=r)
    m = ev.compute()
    counted = t >= 0
    assert abs(m.kl - ref_kl(r, z)[counted].mean()) < 2e-6
    assert m.same_top == np.mean(z.argmax(1)[counted] == r.argmax(1)[counted])
    assert math.isnan(m.accuracy)


@pytest.mark.filterwarnings("error")  # (it set a view's shape, which numpy 2.5 deprecates)
def test_rows_of_a_view_that_cannot_be_flattened(monkeypatch):
    """row_blocks on numpy without reshape(copy=) (before 2.1) still views."""
    from lmmetrics._engine import inputs as _inputs

    real = np.reshape

    def old_reshape(a, shape, **kw):
        if "copy" in kw:
            raise TypeError("reshape() got an unexpected keyword argument 'copy'")
        return real(a, shape)

    z = np.random.default_rng(8).standard_normal((3, 4, 9)).astype(np.float32)
    # views of every kind: numpy's own reshape(copy=False) (2.1 on) says
    # which flatten to rows without a copy; the path before 2.1 agrees
    big = np.random.default_rng(9).standard_normal((4, 6, 5, 9)).astype(np.float32)
    views = [z, z.transpose(1, 0, 2), z[:, ::2], z[::2], z[:1], z[:, :1], z[:0], big[:, :1, ::2], big[1:3, 2:3],
             big[:, 1:2, 1:2], big[..., ::2], np.broadcast_to(z[:1], (5, 4, 9)), big.transpose(0, 2, 1, 3),
             big[None, :, 1, 1:2]]
    want = []
    for v in views:
        try:
            want.append(real(v, (-1, v.shape[-1]), copy=False))
        except TypeError:  # numpy before 2.1 itself: the comparison is not possible
            want = None
            break
        except ValueError:
            want.append(None)
    monkeypatch.setattr(_inputs.np, "reshape", old_reshape)
    if want is not None:
        for v, w in zip(views, want):
            got = _inputs._as_rows(v)
            assert (got is None) == (w is None), v.strides
            if got is not None:
                assert got.shape == w.shape and (got.size == 0 or np.shares_memory(got, v))
                np.testing.assert_array_equal(got, w)
    blocks = list(_inputs.row_blocks(z))
    assert len(blocks) == 1 and np.shares_memory(blocks[0][0], z) and blocks[0][0].shape == (12, 9)
    blocks = list(_inputs.row_blocks(z.transpose(1, 0, 2)))  # not one block: split along axis 0
    assert len(blocks) == 4 and all(np.shares_memory(b, z) for b, _ in blocks)
    r = z.astype(np.float16)
    np.testing.assert_allclose(lmmetrics.token_kl(r, reference_logits=z),
                               ref_kl(z, r.astype(np.float64)), atol=2e-6)
