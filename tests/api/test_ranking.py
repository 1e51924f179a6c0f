"""Rank, top-k accuracy, reciprocal rank, confidence and calibration
(lmmetrics.ranking and the kernel's rank / top_logprob outputs) against
numpy references written here: the rank as the count of z > z_t plus
z == z_t at a lower index in float64 over the values the kernel read (and
as a place in numpy's stable sort), the ECE binned independently."""
import math

import numpy as np
import pytest

import lmmetrics
from lmmetrics._engine import cuda as _cuda, inputs as _inputs
from lmmetrics import _engine
from helpers import BF16, DTYPES

V = 1100


def grid_logits(rng, shape, dtype, step=1 / 16, scale=3.0):
    """Logits on a grid every dtype holds exactly: ties are exact, and no
    two distinct values lie within a few ulps (capped or not)."""
    return (np.round(rng.standard_normal(shape) * scale / step) * step).astype(dtype)


def ref_rank(z, t, ignore_index=-100, cap=None):
    """The values above the target's plus those equal to it at a lower index
    (ties by index, as argmax), in float64; -1 where ignored."""
    zz = np.asarray(z).astype(np.float64).reshape(-1, np.shape(z)[-1])
    if cap:
        zz = np.tanh(zz / cap) * cap
    tt = np.asarray(t).reshape(-1)
    out = np.full(tt.shape, -1, np.int64)
    for i, k in enumerate(tt):
        if k >= 0 and k != ignore_index:
            out[i] = np.count_nonzero(zz[i] > zz[i, k]) + np.count_nonzero(zz[i, :k] == zz[i, k])
    return out.reshape(np.shape(t))


def sorted_place(z, t):
    """The target's place in its row sorted by decreasing value, ties in
    index order (numpy's stable sort): the rank by another road."""
    zz = np.asarray(z).astype(np.float64).reshape(-1, np.shape(z)[-1])
    tt = np.asarray(t).reshape(-1)
    order = np.argsort(-zz, axis=-1, kind="stable")
    return np.array([int(np.flatnonzero(order[i] == k)[0]) for i, k in enumerate(tt)], np.int64)


def ref_top_logprob(z, cap=None):
    zz = np.asarray(z).astype(np.float64)
    if cap:
        zz = np.tanh(zz / cap) * cap
    m = zz.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # rows holding +inf: NaN, not compared
        return -np.log(np.exp(zz - m).sum(-1))


def ref_calibration(conf, correct, bins):
    """ECE and per-bin data, binned with explicit edges and comparisons."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    counts, acc, mean_conf = np.zeros(bins, int), np.full(bins, np.nan), np.full(bins, np.nan)
    ece = 0.0
    for b in range(bins):
        lo, hi = edges[b], edges[b + 1]
        inb = (conf >= lo) & ((conf < hi) if b < bins - 1 else (conf <= hi))
        counts[b] = inb.sum()
        if counts[b]:
            acc[b] = correct[inb].mean()
            mean_conf[b] = conf[inb].mean()
            ece += counts[b] / conf.size * abs(acc[b] - mean_conf[b])
    return ece, counts, acc, mean_conf


def _special_rows(rng, dtype):
    z = grid_logits(rng, (6, V), np.float32)
    t = rng.integers(0, V, 6)
    z[0, :4] = z[0].max() + 1  # the target tied with the max, two ties before it: rank 2
    t[0] = 2
    z[1, ::3] = -np.inf        # masked entries, the target among them (after the one at 0)
    t[1] = 3
    z[2] += 6e4                # a huge offset: maxima beyond the float exp's range (the exact path)
    t[3] = -100                # ignored
    z[4, 17] = np.inf          # +inf: the exact path
    z[5, :] = 0.0              # all tied
    return z.astype(dtype), t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cap", [None, 30.0], ids=["nocap", "softcap"])
def test_rank_and_top_logprob_every_isa(isa, dtype, cap):
    rng = np.random.default_rng(1)
    z = grid_logits(rng, (3, 7, V), dtype)
    t = rng.integers(0, V, (3, 7))
    t[0, ::3] = -100
    want_rank = ref_rank(z, t, cap=cap)
    # ties at an exact grid value, some before the target: ranked by index
    zz = z.astype(np.float64).reshape(-1, V)
    tt = t.reshape(-1)
    tied_before = [k >= 0 and (zz[i, :k] == zz[i, k]).any() for i, k in enumerate(tt)]
    assert sum(tied_before) > 5 and (want_rank == 0).sum() < want_rank.size and (want_rank > 0).any()
    np.testing.assert_array_equal(lmmetrics.token_rank(z, t, softcap=cap), want_rank)
    res = _engine.run(z, t, softcap=cap, nll=True, entropy=True, argmax=True, rank=True, top_logprob=True)
    np.testing.assert_array_equal(res.rank.reshape(t.shape), want_rank)
    tol = 1e-13 if dtype == np.float64 else 2e-6
    want_top = np.where(t.reshape(-1) >= 0, ref_top_logprob(z, cap).reshape(-1), 0.0)
    np.testing.assert_allclose(res.top_logprob, want_top, atol=tol, rtol=0)
    # the same bits with fewer outputs asked
    alone = _engine.run(z, t, softcap=cap, rank=True)
    np.testing.assert_array_equal(alone.rank, res.rank)
    np.testing.assert_array_equal(_engine.run(z, softcap=cap, top_logprob=True).top_logprob[t.reshape(-1) >= 0],
                                  res.top_logprob[t.reshape(-1) >= 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(isa, dtype):
    rng = np.random.default_rng(2)
    z, t = _special_rows(rng, dtype)
    got = _engine.run(z, t, rank=True, top_logprob=True, argmax=True)
    want = ref_rank(z, t)
    np.testing.assert_array_equal(got.rank, want)
    assert got.rank[0] == 2 and got.rank[3] == -1 and got.rank[5] == t[5]  # all tied: its index
    assert got.rank[1] == np.count_nonzero(z[1] > -np.inf) + 1  # -inf: the finite ones, the -inf at 0
    assert got.rank[4] >= 1  # the +inf entry is above a finite target
    assert got.argmax[0] == 0 and got.argmax[5] == 0
    finite = [0, 1, 2, 5]
    tol = 1e-13 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(got.top_logprob[finite], ref_top_logprob(z[finite]), atol=tol)
    assert got.top_logprob[4] == 0.0 and got.top_logprob[3] == 0.0  # one +inf: all the mass; ignored: 0
    assert got.top_logprob[5] == pytest.approx(-math.log(V), abs=tol)


def tied_logits(rng, shape, dtype):
    """Logits full of ties: bfloat16's own rounding of N(0, 3) (about 300
    distinct values in a row of 32000), or for the other dtypes values on a
    grid of 1/8; and in each row a run of copies of its max."""
    if dtype == BF16:
        z = (rng.standard_normal(shape) * 3).astype(BF16)
    else:
        z = grid_logits(rng, shape, dtype, step=1 / 8)
    flat = z.reshape(-1, shape[-1])
    for i in range(flat.shape[0]):
        at = rng.integers(0, shape[-1], 5)
        flat[i, at] = flat[i].max()
    return z


def tied_targets(rng, z):
    """Per row: a random target, or one tied with the row's max (the first
    copy or a later one), or one at a step's edge (31, 32, 33, 63, 64)."""
    flat = z.reshape(-1, z.shape[-1]).astype(np.float64)
    t = rng.integers(0, z.shape[-1], flat.shape[0])
    for i in range(flat.shape[0]):
        tops = np.flatnonzero(flat[i] == flat[i].max())
        t[i] = [t[i], tops[0], tops[-1], rng.choice(tops), [31, 32, 33, 63, 64][i % 5]][i % 5]
    return t.reshape(z.shape[:-1])


TIE_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)] + (
    [BF16] if BF16 is not None else [])


@pytest.mark.parametrize("dtype", TIE_DTYPES, ids=str)
def test_ties_are_ranked_by_index_on_every_isa(isa, dtype):
    """Ties are broken by index, as the first argmax: the rank is the
    float64 count (and the place in numpy's stable sort), 0 exactly where
    the argmax is the target, and top-1 accuracy is evaluate's accuracy;
    the same for 1 to 3 threads, and for one long row cut into segments
    (ties across them, targets at their edges)."""
    rng = np.random.default_rng(11)
    z = tied_logits(rng, (24, 32000), dtype)
    t = tied_targets(rng, z)
    want = ref_rank(z, t)
    np.testing.assert_array_equal(want, sorted_place(z, t))
    assert (want == 0).sum() >= 6 and (want[1::5] == 0).all() and (want[2::5] > 0).all()
    argmax = np.argmax(z.astype(np.float64), -1)
    for threads in (1, 2, 3):
        got = lmmetrics.token_rank(z, t, num_threads=threads)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got == 0, argmax == t)
        m = lmmetrics.evaluate(z, t, top_k=(1, 5), num_threads=threads)
        assert m.top_k_accuracy[1] == m.accuracy == lmmetrics.top_k_accuracy(z, t, k=1) == np.mean(argmax == t)
        assert m.top_k_accuracy[5] == np.mean(want < 5)
        assert m.mean_reciprocal_rank == pytest.approx(np.mean(1 / (want + 1.0)), rel=1e-15)
    # one long row: segments of 32768 (and two halves of a 40000 row)
    for n in (40000, 70000):
        row = tied_logits(rng, (1, n), dtype)
        row[0, [5, 32767, 32768, 32769, n - 1]] = row[0].max()
        targets = [5, 32767, 32768, 32769, n - 1, 0, 20000, 32766, 65536 % n, 65537 % n]
        got = [int(lmmetrics.token_rank(row, np.array([k]), num_threads=2)[0]) for k in targets]
        assert got == [int(r) for r in ref_rank(np.repeat(row, len(targets), 0), np.array(targets))]
        assert got[:5] == sorted(got[:5]) and got[0] == int((row[0, :5] == row[0].max()).sum())


def test_ranks_of_targets_at_minus_inf(isa):
    """A target at -inf ranks after every finite value and after the -inf
    values before it (on the vector steps, their tail and the exact path)."""
    rng = np.random.default_rng(12)
    for n in (3, 40, 1000, 40000):
        z = grid_logits(rng, (4, n), np.float32)
        z[:, ::3] = -np.inf
        t = np.array([0, 3 * (n // 6), 3 * ((n - 1) // 3), 3 * ((n - 1) // 3)])
        z[3, 1] = np.inf  # +inf: the exact path
        np.testing.assert_array_equal(lmmetrics.token_rank(z, t), ref_rank(z, t))
        np.testing.assert_array_equal(lmmetrics.token_rank(z[:1], t[:1]), ref_rank(z[:1], t[:1]))


def test_threads_give_the_same_ranks():
    rng = np.random.default_rng(3)
    z = grid_logits(rng, (3, 70000), np.float32)  # rows of several segments: split across threads
    t = rng.integers(0, 70000, 3)
    results = [_engine.run(z, t, rank=True, top_logprob=True, num_threads=n) for n in (1, 2, 3)]
    for r in results[1:]:
        np.testing.assert_array_equal(r.rank, results[0].rank)
        np.testing.assert_array_equal(r.top_logprob, results[0].top_logprob)
    np.testing.assert_array_equal(results[0].rank, ref_rank(z, t))


def test_shift_ignore_index_and_public_functions():
    rng = np.random.default_rng(4)
    z = grid_logits(rng, (2, 6, 50), np.float32)
    ids = rng.integers(0, 50, (2, 6))
    ids[0, 3] = 7
    got = lmmetrics.token_rank(z, ids, shift=True, ignore_index=7)
    want = ref_rank(z[:, :-1], ids[:, 1:], ignore_index=7)
    assert got.shape == (2, 5) and got.dtype == np.int64 and got[0, 2] == -1
    np.testing.assert_array_equal(got, want)
    counted = want[want >= 0]
    for k in (1, 3, 50):
        assert lmmetrics.top_k_accuracy(z, ids, k=k, shift=True, ignore_index=7) == np.mean(counted < k)
    assert lmmetrics.mean_reciprocal_rank(z, ids, shift=True, ignore_index=7) == pytest.approx(
        np.mean(1.0 / (counted + 1)), rel=1e-15)
    conf = lmmetrics.token_confidence(z, shift=True)
    assert conf.shape == (2, 5) and conf.dtype == np.float32
    np.testing.assert_allclose(conf, np.exp(ref_top_logprob(z[:, :-1])), rtol=2e-6)
    # nothing counted
    assert math.isnan(lmmetrics.top_k_accuracy(z, np.full((2, 6), -100), k=1))
    assert math.isnan(lmmetrics.mean_reciprocal_rank(z, np.full((2, 6), -100)))


def test_bad_arguments():
    z = np.zeros((2, 5), np.float32)
    t = np.array([0, 1])
    for k in (0, 6, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must"):
            lmmetrics.top_k_accuracy(z, t, k=k)
    for bins in (0, -3):
        with pytest.raises(ValueError, match="bins"):
            lmmetrics.calibration(z, t, bins=bins)
    for bins in (2.0, "3", None, True):
        with pytest.raises(TypeError, match="bins"):
            lmmetrics.expected_calibration_error(z, t, bins=bins)
    with pytest.raises(ValueError, match="targets are required for the rank"):
        _engine.run(z, rank=True)
    with pytest.raises(ValueError):
        lmmetrics.token_rank(z, np.array([0, 5]))
    with pytest.raises(ValueError, match="NaN"):
        lmmetrics.token_rank(np.full((1, 5), np.nan, np.float32), np.array([1]))


def test_calibration_against_numpy():
    rng = np.random.default_rng(5)
    z = (rng.standard_normal((400, 6)) * rng.uniform(0.1, 4, (400, 1))).astype(np.float32)
    t = rng.integers(0, 6, 400)
    t[::7] = -100
    z[:5] = 0.0                               # ties: the first argmax rule (index 0)
    t[:5] = [0, 1, 0, 2, 0]
    z[5, 2] = 200.0                           # confidence exactly 1.0: in the last bin
    t[5] = 2
    counted = t >= 0
    zz = z[counted].astype(np.float64)
    conf = np.exp(ref_top_logprob(zz))
    correct = np.argmax(zz, 1) == t[counted]
    for bins in (1, 3, 10, 15, 40):
        cal = lmmetrics.calibration(z, t, bins=bins)
        ece, counts, acc, mean_conf = ref_calibration(conf, correct, bins)
        np.testing.assert_array_equal(cal.counts, counts)
        np.testing.assert_allclose(cal.edges, np.linspace(0, 1, bins + 1))
        np.testing.assert_allclose(cal.accuracy, acc, rtol=1e-12)
        np.testing.assert_allclose(cal.confidence, mean_conf, rtol=1e-6)
        assert cal.ece == pytest.approx(ece, abs=1e-6)
        assert lmmetrics.expected_calibration_error(z, t, bins=bins) == cal.ece
        assert cal.total == counted.sum()
    assert lmmetrics.calibration(z, t, bins=40).counts[-1] >= 1  # confidence 1.0 lands in the closed last bin


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
def test_tied_confidence_at_a_bin_edge(isa, dtype):
    """A row whose top k logits tie, the rest ruled out, has confidence
    exactly 1/k: at a bin edge, it is in the bin that edge opens, as exact
    arithmetic and torchmetrics put it (exp(-ln 10) is 0.09999999999999998,
    which was binned below 0.1)."""
    tm = pytest.importorskip("torchmetrics.functional.classification")
    torch = pytest.importorskip("torch")
    for k, bins in ((10, 10), (10, 20), (10, 100), (9, 9), (17, 17), (4, 12), (2, 2)):
        z = np.full((1, 64), -np.inf, dtype)
        z[0, :k] = 0.0
        cal = lmmetrics.calibration(z, np.array([0]), bins=bins)
        assert cal.counts.tolist() == [int(b == bins // k) for b in range(bins)], (k, bins)
    # a uniform row over 10 tokens (right, 0.1) and a row at 0.15 (wrong): one bin, [0.1, 0.2)
    p = np.full((2, 10), 0.85 / 9)
    p[0], p[1, 0] = 0.1, 0.15
    z = np.log(p).astype(dtype)
    z[0] = 0.0
    t = np.array([0, 1])
    want = tm.multiclass_calibration_error(torch.softmax(torch.from_numpy(z).double(), -1), torch.from_numpy(t),
                                           num_classes=10, n_bins=10, norm="l1").item()
    assert want == pytest.approx(abs(0.5 - 0.125))
    got = lmmetrics.calibration(z, t, bins=10)
    assert got.counts.tolist() == [0, 2] + [0] * 8
    assert got.ece == pytest.approx(want, abs=1e-6)
    ev = lmmetrics.Evaluator(calibration_bins=10)
    ev.update(z, t)
    assert ev.compute().ece == got.ece
    ev.load_state_dict(ev.state_dict())  # the bin's confidence just below its edge passes the state's check
    assert ev.compute().calibration.counts.tolist() == got.counts.tolist()
    # user confidences: 1/10 computed either way lands at the edge; a confidence clearly below it does not
    one = lmmetrics.Calibration.from_arrays(np.array([np.exp(-np.log(10.0)), 0.1, 0.1 - 1e-9]), np.ones(3, bool),
                                            bins=10)
    assert one.counts.tolist() == [1, 2] + [0] * 8


def test_calibration_bins_merge():
    rng = np.random.default_rng(6)
    conf = rng.uniform(0, 1, 300)
    conf[:3] = [0.0, 1.0, 0.5]
    ok = rng.uniform(0, 1, 300) < conf
    whole = lmmetrics.Calibration.from_arrays(conf, ok, bins=4)
    merged = lmmetrics.Calibration.from_arrays(conf[:100], ok[:100], bins=4).add(
        lmmetrics.Calibration.from_arrays(conf[100:], ok[100:], bins=4))
    np.testing.assert_array_equal(merged.counts, whole.counts)
    np.testing.assert_array_equal(merged.correct, whole.correct)
    np.testing.assert_allclose(merged.conf_sum, whole.conf_sum, rtol=1e-14)
    ece, counts, acc, _ = ref_calibration(conf, ok, 4)
    assert whole.ece == pytest.approx(ece, rel=1e-12)
    np.testing.assert_array_equal(whole.counts, counts)
    # an empty bin is NaN, and adds nothing to the ECE
    one = lmmetrics.Calibration.from_arrays(np.array([0.95]), np.array([True]), bins=3)
    assert np.isnan(one.accuracy[0]) and one.counts.tolist() == [0, 0, 1] and one.ece == pytest.approx(0.05)
    assert math.isnan(lmmetrics.Calibration.from_arrays(np.array([]), np.array([], bool), bins=3).ece)
    with pytest.raises(ValueError, match="cannot add"):
        one.add(whole)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        lmmetrics.Calibration.from_arrays(np.array([1.5]), np.array([True]))
    # correctness: booleans, or 0 and 1 (0.5 or NaN was counted correct)
    for bad in ([0.5, 1.0], [np.nan, 0.0], [2, 0]):
        with pytest.raises(ValueError, match="correct must hold booleans"):
            lmmetrics.Calibration.from_arrays(np.array([0.5, 0.7]), bad, bins=2)
    assert lmmetrics.Calibration.from_arrays(np.array([0.2, 0.7]), [1.0, 0], bins=2).accuracy.tolist() == [1.0, 0.0]
    with pytest.raises(AttributeError):
        one.counts = None  # frozen


torch = pytest.importorskip("torch")


def _routed(monkeypatch):
    calls = []
    compute = _cuda.compute
    monkeypatch.setattr(_cuda, "compute", lambda *a: calls.append(1) or compute(*a))
    routed = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    monkeypatch.setattr(_inputs, "is_cuda", routed)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_torch_cpu_tensors_and_the_cuda_path(monkeypatch, dtype):
    rng = np.random.default_rng(7)
    z = torch.from_numpy(grid_logits(rng, (4, 9, 300), np.float32)).to(dtype)
    z[0, 0, 5] = math.inf  # the CUDA path's exact rows
    z[1, 1] = 0.0
    t = torch.from_numpy(rng.integers(0, 300, (4, 9)))
    t[2, ::2] = -100
    zn = z.double().numpy()
    for cap in (None, 30.0):
        want = ref_rank(zn, t.numpy(), cap=cap)
        got = lmmetrics.token_rank(z, t, softcap=cap)  # CPU tensors: the native core
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), want)
        calls = _routed(monkeypatch)
        for extra in ({}, {"nll": True}):
            res = _engine.run(z, t, softcap=cap, rank=True, top_logprob=True, **extra)
            np.testing.assert_array_equal(res.rank.reshape(t.shape), want)
            finite = (np.isfinite(zn).all(-1).reshape(-1) | bool(cap)) & (t.numpy().reshape(-1) >= 0)
            tol = 1e-12 if dtype == torch.float64 else 3e-5
            np.testing.assert_allclose(res.top_logprob[finite], ref_top_logprob(zn, cap).reshape(-1)[finite],
                                       atol=tol)
            assert res.top_logprob[0] == 0.0 or cap  # one +inf logit: all the mass (capped: 30)
        conf = lmmetrics.token_confidence(z, softcap=cap)
        assert isinstance(conf, torch.Tensor) and conf.shape == (4, 9)
        cal = lmmetrics.calibration(z, t, bins=5, softcap=cap)
        assert cal.total == int((t >= 0).sum())
        assert calls
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_ties_on_the_cuda_path_and_against_torchmetrics(monkeypatch, dtype):
    """Logits full of ties (bfloat16's own, V = 32000): the rank ties by
    index on the native core (CPU tensors) and on the CUDA path (routed
    here), and top-1 accuracy is accuracy, which torchmetrics'
    multiclass_accuracy(top_k=1) gives too."""
    tm = pytest.importorskip("torchmetrics.functional.classification")
    rng = np.random.default_rng(13)
    if dtype == torch.bfloat16:  # bfloat16's own rounding, each row's max copied to 5 places
        z = torch.from_numpy(rng.standard_normal((2, 20, 32000)).astype(np.float32) * 3).to(dtype)
        for row in z.view(-1, 32000):
            row[torch.from_numpy(rng.integers(0, 32000, 5))] = row.max()
    else:
        z = torch.from_numpy(tied_logits(rng, (2, 20, 32000), np.dtype(np.float32))).to(dtype)
    t = torch.from_numpy(tied_targets(rng, z.float().numpy()))
    t[1, ::4] = -100
    zn, tn = z.double().numpy(), t.numpy()
    want = ref_rank(zn, tn)
    counted = tn >= 0
    flat = torch.from_numpy(zn[counted])
    acc_tm = tm.multiclass_accuracy(flat, torch.from_numpy(tn[counted]), num_classes=32000, top_k=1,
                                    average="micro").item()
    assert acc_tm == pytest.approx(np.mean(want[counted] == 0), abs=1e-7)
    assert 0 < np.mean(want[counted] == 0) < np.mean(want[counted] <= 3)  # ties decided: not all hits
    for routed in (False, True):
        calls = _routed(monkeypatch) if routed else None
        got = lmmetrics.token_rank(z, t)
        np.testing.assert_array_equal(got.numpy(), want)
        m = lmmetrics.evaluate(z, t, top_k=(1, 3))
        assert m.top_k_accuracy[1] == m.accuracy == lmmetrics.top_k_accuracy(z, t, k=1)
        assert m.accuracy == pytest.approx(acc_tm, abs=1e-7)
        assert m.top_k_accuracy[3] == np.mean(want[counted] < 3)
        if routed:
            assert calls
            monkeypatch.undo()


@pytest.mark.parametrize("where", ["numpy", "torch"])
def test_lazy_logits_tiles(where):
    rng = np.random.default_rng(8)
    h = rng.standard_normal((2, 7, 8)).astype(np.float32)
    w = np.round(rng.standard_normal((V, 8)) * 4) / 4
    w = w.astype(np.float32)
    w[5] = w[6] = w[1000]                         # three tied columns, the last in another block
    ids = rng.integers(0, V, (2, 7))
    ids[0, 2] = 5
    ids[0, 3] = 6
    ids[1, 0] = 1000
    ids[1, 4] = -100
    zfull = h @ w.T
    if where == "torch":
        h, w = torch.from_numpy(h), torch.from_numpy(w)
    for cap, budget in ((None, 4 * 300 * 4), (None, None), (25.0, 4 * 300 * 4)):
        lazy = lmmetrics.projected(h, w, chunk_bytes=budget)
        zcap = zfull if cap is None else np.tanh(zfull.astype(np.float64) / cap) * cap
        got = lmmetrics.token_rank(lazy, ids, shift=False, softcap=cap)
        if where == "torch":
            got = got.numpy()
        np.testing.assert_array_equal(got, ref_rank(zcap, ids))
        res = _engine.run(lazy, ids, shift=False, softcap=cap, top_logprob=True, argmax=True)
        counted = ids.reshape(-1) >= 0
        np.testing.assert_allclose(res.top_logprob[counted], ref_top_logprob(zcap).reshape(-1)[counted], atol=1e-5)
        np.testing.assert_array_equal(res.argmax[counted], np.argmax(zcap, -1).reshape(-1)[counted])
        assert lmmetrics.calibration(lazy, ids, bins=4, shift=False, softcap=cap).total == counted.sum()


def test_bfloat16_numpy_rank():
    if BF16 is None:
        pytest.skip("ml_dtypes")
    rng = np.random.default_rng(9)
    z = grid_logits(rng, (5, 300), BF16, step=1 / 4)
    t = rng.integers(0, 300, 5)
    np.testing.assert_array_equal(lmmetrics.token_rank(z, t), ref_rank(z, t))
