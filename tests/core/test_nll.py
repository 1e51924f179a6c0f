"""token_nll against a float64 reference: vocab sizes, dtypes, layouts, ISAs,
threads, edge values and the ignore rules."""
import math

import numpy as np
import pytest

import lmmetrics
from helpers import BF16, BF16_PARAM, DTYPES, random_logits, ref_entropy, ref_nll

VOCABS = [1, 2, 15, 16, 17, 33, 50257]


def _tol(dtype):
    # float64: the reference's own lse - z cancels to ~ulp(lse) near NLL 0
    return dict(rtol=1e-12, atol=1e-13) if dtype == np.float64 else dict(rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", VOCABS)
def test_matches_float64_reference(isa, dtype, V):
    rng = np.random.default_rng(V)
    z = random_logits(rng, (9, V), dtype)
    t = rng.integers(0, V, 9)
    got = lmmetrics.token_nll(z, t)
    assert got.shape == (9,)
    assert got.dtype == (np.float64 if dtype == np.float64 else np.float32)
    np.testing.assert_allclose(got.astype(np.float64), ref_nll(z, t), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_rows_split_in_segments(isa, dtype):
    # 3 segments and a tail: rows longer than one segment merge exactly
    rng = np.random.default_rng(1)
    V = 70001
    z = random_logits(rng, (3, V), dtype, scale=4.0)
    z[1, 68000] = 30  # the max in the last segment
    t = np.array([5, 68000, V - 1])
    np.testing.assert_allclose(lmmetrics.token_nll(z, t).astype(np.float64), ref_nll(z, t), **_tol(dtype))


def test_float32_large_vocab_accuracy(isa):
    rng = np.random.default_rng(7)
    z = random_logits(rng, (16, 128256), np.float32, scale=5.0)
    t = rng.integers(0, 128256, 16)
    err = np.abs(lmmetrics.token_nll(z, t).astype(np.float64) - ref_nll(z, t)).max()
    assert err < 2e-6
    total = lmmetrics.cross_entropy(z, t, reduction="sum")
    assert abs(total - ref_nll(z, t).sum()) <= 1e-8 * abs(total)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_maxima_rising_far_past_the_first_block(isa, dtype):
    # the first block's max sets the kernel's shift; a later block 40 or 80
    # above it is done again against a higher shift, and a block below
    # every earlier one changes nothing
    rng = np.random.default_rng(11)
    V = 9000
    z = random_logits(rng, (5, V), dtype)
    z[0, 5000] = 40
    z[1, 3000:3100] = 80
    z[2, :2000] = -np.inf  # no shift at all before a finite block
    z[3, 1:] -= 200
    z[4, 4000] = 41
    z[4, 8500] = 90
    t = np.array([5000, 3050, 2500, 0, 8500])
    np.testing.assert_allclose(lmmetrics.token_nll(z, t).astype(np.float64), ref_nll(z, t), **_tol(dtype))
    tol = 2e-6 if dtype != np.float64 else 1e-12
    np.testing.assert_allclose(lmmetrics.token_entropy(z).astype(np.float64), ref_entropy(z), atol=tol)
    expected = (np.asarray(z).astype(np.float64).argmax(-1) == t).mean()  # rows 0, 3, 4
    assert lmmetrics.evaluate(z, t).accuracy == pytest.approx(expected) == 0.6


@pytest.mark.parametrize("scale", [1e6, -1e6, 3e38])
def test_maxima_beyond_the_fast_range_take_the_exact_path(isa, scale):
    z = np.array([[1.0, 0.0, -2.0, 0.5] * 50] * 2, np.float32)
    z[0] += np.float32(scale) if abs(scale) < 1e38 else 0
    if abs(scale) >= 1e38:
        z[1, 3] = scale  # one huge entry: all mass there
    t = np.array([0, 3])
    got = lmmetrics.token_nll(z, t).astype(np.float64)
    np.testing.assert_allclose(got, ref_nll(z, t), atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nll_entropy_and_kl_are_never_negative(isa, dtype):
    # a near-certain target: the NLL is ~1e-13 and must not come out below
    # 0; a one-hot row's entropy is 0; a row against itself has KL 0
    rng = np.random.default_rng(12)
    z = random_logits(rng, (40, 300), dtype, scale=1.0)
    t = rng.integers(0, 300, 40)
    z[np.arange(40), t] = (rng.uniform(25, 35, 40)).astype(dtype)
    nll = lmmetrics.token_nll(z, t)
    assert (nll >= 0).all()
    np.testing.assert_allclose(nll.astype(np.float64), ref_nll(z, t), **_tol(dtype))
    onehot = np.full((3, 70), -np.inf, dtype)
    onehot[:, 5] = np.array([-7.3, 0.0, 11.1]).astype(dtype)
    np.testing.assert_allclose(lmmetrics.token_entropy(onehot), 0, atol=1e-12)
    assert (lmmetrics.token_nll(onehot, np.array([5, 5, 5])) == 0).all()
    assert (lmmetrics.token_kl(z, reference_logits=z) == 0).all()


def test_three_d_and_shifted_views(isa):
    rng = np.random.default_rng(2)
    full = random_logits(rng, (3, 11, 40), np.float32)
    ids = rng.integers(0, 40, (3, 11))
    logits, targets = full[:, :-1], ids[:, 1:]  # the usual shift: strided leading axes
    assert not logits.flags.c_contiguous
    np.testing.assert_allclose(lmmetrics.token_nll(logits, targets), ref_nll(logits, targets), atol=2e-6)
    # every other row of a 2-D buffer, and a reversed view
    flat = full.reshape(-1, 40)
    np.testing.assert_allclose(lmmetrics.token_nll(flat[::2], ids.reshape(-1)[::2]),
                               ref_nll(flat[::2], ids.reshape(-1)[::2]), atol=2e-6)
    np.testing.assert_allclose(lmmetrics.token_nll(flat[::-1], ids.reshape(-1)),
                               ref_nll(flat[::-1], ids.reshape(-1)), atol=2e-6)
    # 4-D with a strided middle axis (three groups of rows: copied, same numbers)
    four = random_logits(rng, (2, 3, 5, 17), np.float32)[:, ::2, :-1]
    t4 = rng.integers(0, 17, four.shape[:-1])
    np.testing.assert_allclose(lmmetrics.token_nll(four, t4), ref_nll(four, t4), atol=2e-6)
    # a strided vocabulary axis is copied
    wide = random_logits(rng, (4, 30), np.float32)[:, ::2]
    tw = rng.integers(0, 15, 4)
    np.testing.assert_allclose(lmmetrics.token_nll(wide, tw), ref_nll(wide, tw), atol=2e-6)


def test_one_dimensional_logits_and_scalar_target():
    z = np.array([1.0, 2.0, 3.0], np.float32)
    got = lmmetrics.token_nll(z, np.int64(2))
    assert np.shape(got) == ()
    assert abs(float(got) - ref_nll(z, np.int64(2))) < 2e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16_PARAM], ids=str)
def test_threads_give_identical_bits(isa, dtype):
    rng = np.random.default_rng(3)
    for shape in [(64, 5000), (1, 100000), (3, 70000)]:  # many rows; one long row split across threads
        z = random_logits(rng, shape, dtype)
        t = rng.integers(0, shape[1], shape[0])
        one = lmmetrics.token_nll(z, t, num_threads=1)
        two = lmmetrics.token_nll(z, t, num_threads=2)
        four = lmmetrics.token_nll(z, t, num_threads=4)
        assert one.tobytes() == two.tobytes() == four.tobytes()
        sums = {lmmetrics.cross_entropy(z, t, reduction="sum", num_threads=k) for k in (1, 2, 3)}
        assert len(sums) == 1


def test_ignore_rules(isa):
    rng = np.random.default_rng(4)
    z = random_logits(rng, (6, 10), np.float32)
    t = np.array([1, -100, -1, 3, 7, -5])
    got = lmmetrics.token_nll(z, t)
    ref = ref_nll(z, t)
    assert got[1] == got[2] == got[5] == 0.0
    np.testing.assert_allclose(got, ref, atol=2e-6)
    # a custom ignore_index is ignored too, negatives still are
    got = lmmetrics.token_nll(z, np.array([1, 7, -1, 3, 7, 0]), ignore_index=7)
    assert got[1] == got[2] == got[4] == 0.0 and got[0] > 0
    mean = lmmetrics.cross_entropy(z, t)
    assert abs(mean - ref[[0, 3, 4]].mean()) < 2e-6


def test_ignored_rows_are_not_read(isa):
    z = np.full((3, 20), np.nan, np.float32)
    z[1] = np.linspace(-1, 1, 20)
    t = np.array([-100, 4, -1])
    got = lmmetrics.token_nll(z, t)
    assert got[0] == got[2] == 0.0 and np.isfinite(got[1])


def test_masked_vocabulary(isa):
    for dtype in [d for d in DTYPES if isinstance(d, np.dtype)]:  # bfloat16 where ml_dtypes is installed
        z = np.linspace(-3, 3, 40).astype(dtype).reshape(2, 20)
        z[:, ::3] = -np.inf
        got = lmmetrics.token_nll(z, np.array([1, 3]))
        np.testing.assert_allclose(got.astype(np.float64), ref_nll(z, np.array([1, 3])), **_tol(dtype))
        assert math.isinf(lmmetrics.token_nll(z, np.array([0, 1]))[0])  # a -inf target: +inf


def test_positive_infinity(isa):
    # softmax puts all mass on the +inf entries, equally
    z = np.zeros((3, 50), np.float32)
    z[:, 7] = np.inf
    z[1, 30] = np.inf
    got = lmmetrics.token_nll(z, np.array([7, 30, 8]))
    assert got[0] == 0.0
    assert abs(got[1] - math.log(2)) < 1e-7
    assert math.isinf(got[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_is_an_error_naming_the_row(isa, dtype):
    z = np.zeros((4, 37), dtype)
    z[2, 36] = np.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 2"):
        lmmetrics.token_nll(z, np.array([0, 1, 2, 3]))
    z = np.full((2, 5000), -np.inf, dtype)  # NaN hidden among -inf
    z[0, 0] = 0
    z[1, 4321] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        lmmetrics.token_nll(z, np.array([0, 1]))
    z = np.zeros((1, 40000), dtype)  # NaN next to +inf
    z[0, 3] = np.inf
    z[0, 39000] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        lmmetrics.token_nll(z, np.array([0]))


@pytest.mark.parametrize("bits", [0x7FC00123, 0xFF800001, 0xFFC00000, 0x7F8001FF])
def test_nan_with_any_payload_or_sign_is_found(isa, bits):
    # the sums carry NaN through the exp: whatever its sign and payload bits
    z = np.zeros((2, 3000), np.float32)
    z.view(np.uint32)[1, 2500] = bits
    with pytest.raises(ValueError, match="NaN in logits at row 1"):
        lmmetrics.token_nll(z, np.array([0, 0]))
    if BF16:
        h = np.zeros((2, 3000), BF16)
        h.view(np.uint16)[1, 2501] = bits >> 16 | 0x40  # a bfloat16 NaN of that sign
        with pytest.raises(ValueError, match="NaN in logits at row 1"):
            lmmetrics.token_nll(h, np.array([0, 0]))


@pytest.mark.parametrize("bits", [0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FC001FF])
@pytest.mark.parametrize("V", [1, 17, 3000])
def test_nan_with_any_payload_is_found_under_a_softcap(isa, bits, V):
    # the lanes' softcap scales by an integer add to the exponent field: a
    # NaN whose low payload bits reached it came out finite (0x7f800001
    # capped to c, its NLL a number where the row must be an error)
    z = np.zeros((2, V), np.float32)
    z.view(np.uint32)[1, V // 2] = bits
    r = np.zeros((2, V), np.float32)
    with pytest.raises(ValueError, match="NaN in logits at row 1"):
        lmmetrics.token_nll(z, np.array([0, 0]), softcap=3.0)
    with pytest.raises(ValueError, match="NaN in logits at row 1"):
        lmmetrics.token_entropy(z, softcap=3.0)
    with pytest.raises(ValueError, match="NaN in logits at row 1"):
        lmmetrics.token_kl(z, reference_logits=r, softcap=3.0)
    with pytest.raises(ValueError, match="NaN in reference_logits at row 1"):
        lmmetrics.token_kl(r, reference_logits=z, softcap=3.0)


def test_all_neg_inf_row_is_an_error(isa):
    z = np.zeros((3, 20), np.float32)
    z[1] = -np.inf
    with pytest.raises(ValueError, match=r"row 1 .* all -inf"):
        lmmetrics.token_nll(z, np.array([0, 1, 2]))
    assert lmmetrics.token_nll(z, np.array([0, -100, 2]))[1] == 0.0  # ignored: fine


def test_bad_inputs():
    z = np.zeros((4, 10), np.float32)
    t = np.array([1, 2, 3, 4])
    with pytest.raises(ValueError, match="does not match"):
        lmmetrics.token_nll(z, t[:3])
    with pytest.raises(ValueError, match=r"target 10 at position \(2,\) is out of range for a vocabulary of 10"):
        lmmetrics.token_nll(z, np.array([1, 2, 10, 4]))
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        lmmetrics.token_nll(z.astype(np.int32), t)
    with pytest.raises(TypeError, match="integers"):
        lmmetrics.token_nll(z, t.astype(np.float32))
    with pytest.raises(TypeError, match="integers"):
        lmmetrics.token_nll(z, t > 2)
    with pytest.raises(ValueError, match="empty vocabulary"):
        lmmetrics.token_nll(np.zeros((4, 0), np.float32), t)
    with pytest.raises(ValueError, match="num_threads"):
        lmmetrics.token_nll(z, t, num_threads=0)
    with pytest.raises(ValueError, match="reduction"):
        lmmetrics.cross_entropy(z, t, reduction="avg")
    with pytest.raises(ValueError, match="at least one axis"):
        lmmetrics.token_nll(np.float32(1.0), t)


def test_empty_batch():
    z = np.zeros((0, 10), np.float32)
    t = np.zeros(0, np.int64)
    assert lmmetrics.token_nll(z, t).shape == (0,)
    assert math.isnan(lmmetrics.cross_entropy(z, t))
    assert lmmetrics.cross_entropy(z, t, reduction="sum") == 0.0


def test_lists_are_accepted():
    got = lmmetrics.token_nll([[0.0, 0.0]], [1])
    assert abs(got[0] - math.log(2)) < 1e-12  # nested lists become float64


def test_per_token_values_round_to_their_dtype():
    """float32 per-token values are the float64 ones rounded: within 2e-6 +
    float32's half ulp of a float64 reference, however large (595 of these
    1000 rows miss a bare 2e-6, by up to 7.6e-6), while the sums stay
    within 2e-6 a token."""
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((1000, 257)) * 3).astype(np.float32)
    t = rng.integers(0, 257, 1000)
    z[np.arange(1000), t] -= rng.uniform(30, 140, 1000).astype(np.float32)  # NLLs of 30-150 nats
    want = ref_nll(z, t)
    got = lmmetrics.token_nll(z, t)
    assert got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= 2e-6 + 2.0 ** -24 * want).all()
    assert (err > 2e-6).any()  # the rounding the docs describe is real here
    assert lmmetrics.cross_entropy(z, t, reduction="sum") == pytest.approx(want.sum(), rel=0, abs=2e-6 * 1000)
    assert lmmetrics.evaluate(z, t).nll_sum == pytest.approx(want.sum(), rel=0, abs=2e-6 * 1000)
