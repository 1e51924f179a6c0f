"""The CUDA path (torch on the tensor's device, in bounded row chunks).

Where CUDA is absent, the same code runs on CPU tensors routed through it
(the ``torch_route`` fixture), and is checked against float64 references and
against the native core; the tests marked ``cuda`` run on a real GPU when
there is one.
"""
import math
import time

import numpy as np
import pytest

import lmmetrics
from lmmetrics._engine import chunked as _chunked, cuda as _cuda, inputs as _inputs, request as _request
from lmmetrics._engine.cuda import layout, torch_path
from lmmetrics import _engine
from helpers import HostReads, inf_and_nan_head, ref_entropy, ref_kl, ref_nll

torch = pytest.importorskip("torch")
F = torch.nn.functional
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(params=["routed-cpu"] + (["cuda"] if HAS_CUDA else []))
def dev(request, monkeypatch):
    """A device whose tensors take the CUDA path (checked after the test)."""
    calls = []
    launch = _cuda.launch  # (every pass, a lazy logits chunk's too)
    monkeypatch.setattr(_cuda, "launch", lambda *a: calls.append(1) or launch(*a))
    if request.param == "routed-cpu":
        routed = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
        monkeypatch.setattr(_inputs, "is_cuda", routed)
        yield torch.device("cpu")
    else:
        yield torch.device("cuda")
    assert calls, "the CUDA path was not taken"


@pytest.fixture
def small_chunks():
    old = lmmetrics.set_cuda_chunk_bytes(3 * 1000 * 4 * 9)  # a few rows per chunk
    yield
    lmmetrics.set_cuda_chunk_bytes(old)


def _deferred_read(dev):
    """A pass not waited for, as HostReads sees its one transfer: on a CUDA
    device the copy was queued into page-locked memory at launch, so only
    its ``.numpy()``; on routed CPU tensors ``.cpu().numpy()``."""
    return ["numpy"] if dev.type == "cuda" else ["cpu", "numpy"]


def _data(dev, dtype=torch.float32, shape=(4, 13), V=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(*shape, V, generator=g) * 3).to(dtype)
    r = (z.double() + torch.randn(*shape, V, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::5] = -100
    return z.to(dev), r.to(dev), t.to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_per_token_values(dev, small_chunks, dtype):
    z, r, t = _data(dev, dtype)
    zn, rn, tn = z.cpu().double().numpy(), r.cpu().double().numpy(), t.cpu().numpy()
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    nll = lmmetrics.token_nll(z, t)
    assert isinstance(nll, torch.Tensor) and nll.device.type == dev.type and nll.shape == t.shape
    np.testing.assert_allclose(nll.cpu().numpy(), ref_nll(zn, tn), atol=tol, rtol=tol)
    np.testing.assert_allclose(lmmetrics.token_entropy(z).cpu().numpy(), ref_entropy(zn), atol=tol, rtol=tol)
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r).cpu().numpy(), ref_kl(rn, zn), atol=tol, rtol=tol)


def test_evaluate_and_compare_agree_with_the_cpu_core(dev, small_chunks):
    z, r, t = _data(dev, shape=(6, 11))
    tb = torch.randint(0, 5, (1000,))
    got = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r).as_dict()
    zc, rc, tc = z.cpu().numpy(), r.cpu().numpy(), t.cpu().numpy()
    want = lmmetrics.evaluate(zc, tc, token_bytes=tb.numpy(), reference_logits=rc).as_dict()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    c_got = lmmetrics.compare(z, t, reference_logits=r).as_dict()
    c_want = lmmetrics.compare(zc, tc, reference_logits=rc).as_dict()
    assert c_got["ppl"]["value"] == pytest.approx(c_want["ppl"]["value"], rel=1e-6)
    assert c_got["kld"]["max"] == pytest.approx(c_want["kld"]["max"], abs=2e-6)
    assert c_got["same_top"] == c_want["same_top"]


def test_strided_views_and_softcap(dev, small_chunks):
    z, r, t = _data(dev, shape=(3, 9))
    view = z[:, :-1]  # not viewable as one (rows, V) block
    got = lmmetrics.token_nll(view, t[:, 1:], softcap=5.0)
    capped = 5.0 * np.tanh(view.cpu().double().numpy() / 5.0)
    np.testing.assert_allclose(got.cpu().numpy(), ref_nll(capped, t[:, 1:].cpu().numpy()), atol=2e-6)
    np.testing.assert_allclose(lmmetrics.token_kl(view, reference_logits=r[:, :-1]).cpu().numpy(),
                               ref_kl(r[:, :-1].cpu().numpy(), view.cpu().numpy()), atol=2e-6)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                    (torch.float32, torch.float64)], ids=str)
def test_mixed_dtypes_and_shift(dev, small_chunks, dtypes):
    z, r, t = _data(dev, shape=(3, 9))
    z, r = z.to(dtypes[0]), r.to(dtypes[1])
    zn, rn, tn = z.cpu().double().numpy(), r.cpu().double().numpy(), t.cpu().numpy()
    np.testing.assert_allclose(lmmetrics.token_kl(z, reference_logits=r).cpu().numpy(), ref_kl(rn, zn), atol=2e-6)
    c = lmmetrics.compare(z, t, reference_logits=r, shift=True)
    assert c.tokens == int((tn[:, 1:] >= 0).sum())
    assert c.kld.mean.value == pytest.approx(ref_kl(rn[:, :-1], zn[:, :-1])[tn[:, 1:] >= 0].mean(), rel=1e-6)
    assert c.ppl.value == pytest.approx(np.exp(ref_nll(zn[:, :-1], tn[:, 1:])[tn[:, 1:] >= 0].mean()), rel=1e-6)
    lp, greedy = lmmetrics.loglikelihood(z, t, shift=True)
    assert lp.device.type == dev.type and lp.dtype == torch.float64 and greedy.dtype == torch.bool
    np.testing.assert_allclose(lp.cpu().numpy(), -ref_nll(zn[:, :-1], tn[:, 1:]).sum(-1), rtol=1e-6)


def test_edge_cases_match_the_cpu_semantics(dev):
    z = torch.zeros(4, 10, device=dev)
    z[1, [2, 5]] = math.inf          # mass shared by the +inf entries
    z[2, :] = -math.inf              # all -inf, but ignored below: not read
    z[3, ::2] = -math.inf            # masked vocabulary
    t = torch.tensor([0, 5, -100, 1], device=dev)
    nll = lmmetrics.token_nll(z, t).cpu()
    assert nll[0].item() == pytest.approx(math.log(10), rel=1e-6)
    assert nll[1].item() == pytest.approx(math.log(2), rel=1e-6)
    assert nll[2].item() == 0.0
    assert nll[3].item() == pytest.approx(math.log(5), rel=1e-6)
    m = lmmetrics.evaluate(z, t)
    assert m.tokens == 3 and m.entropy == pytest.approx((math.log(10) + math.log(2) + math.log(5)) / 3)
    z[0, 3] = math.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 0"):
        lmmetrics.cross_entropy(z, t)
    z[0, 3] = 0.0
    with pytest.raises(ValueError, match="all -inf"):
        lmmetrics.cross_entropy(z, torch.tensor([0, 5, 1, 1], device=dev))
    with pytest.raises(ValueError, match="out of range"):
        lmmetrics.cross_entropy(z, torch.tensor([0, 5, 10, 1], device=dev))
    # an ignored target is not checked, on either path
    t_big = torch.tensor([0, 5, 99, 1], device=dev)
    want = lmmetrics.cross_entropy(z.cpu().numpy(), t_big.cpu().numpy(), ignore_index=99)
    assert lmmetrics.cross_entropy(z, t_big, ignore_index=99) == pytest.approx(want, rel=1e-6)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA absent")
def test_reference_on_another_device_is_an_error():
    z, r, _ = _data(torch.device("cuda"))
    with pytest.raises(ValueError, match="same device"):
        lmmetrics.token_kl(z, reference_logits=r.cpu())


def test_chunk_setting():
    old = lmmetrics.set_cuda_chunk_bytes(1 << 20)
    assert lmmetrics.set_cuda_chunk_bytes(None) == 1 << 20
    assert lmmetrics.set_cuda_chunk_bytes(old) == layout._DEFAULT_CHUNK_BYTES
    with pytest.raises(ValueError):
        lmmetrics.set_cuda_chunk_bytes(0)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA absent")
def test_cuda_memory_stays_bounded():
    V, N = 32000, 4096
    z = torch.randn(N, V, device="cuda")
    t = torch.randint(0, V, (N,), device="cuda")
    z16 = z.bfloat16()

    def extra(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() - base

    lmmetrics.set_cuda_chunk_bytes(64 * 2**20)
    try:
        used = [extra(lambda: lmmetrics.evaluate(z, t)), extra(lambda: lmmetrics.cross_entropy(z, t)),
                extra(lambda: lmmetrics.evaluate(z16, t)), extra(lambda: lmmetrics.cross_entropy(z16, t))]
    finally:
        lmmetrics.set_cuda_chunk_bytes(None)
    assert max(used) <= 64 * 2**20 * 1.25, used
    assert lmmetrics.cross_entropy(z, t) == pytest.approx(F.cross_entropy(z.double(), t).item(), rel=1e-6)


def test_rows_the_fast_path_cannot_certify_take_the_exact_path(dev):
    # a +inf row beside ordinary rows, and a target whose logit is -inf:
    # the chunk is done again exactly, and every row matches the native core
    z, _, t = _data(dev, shape=(8,), V=50, seed=3)
    z[2, 7] = math.inf
    z[5, 11] = -math.inf
    t[5] = 11
    got = lmmetrics.token_nll(z, t).cpu().numpy()
    want = lmmetrics.token_nll(z.cpu().numpy(), t.cpu().numpy())
    assert got[5] == math.inf and want[5] == math.inf
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    ent = lmmetrics.token_entropy(z).cpu().numpy()
    np.testing.assert_allclose(ent, lmmetrics.token_entropy(z.cpu().numpy()), rtol=2e-6, atol=2e-6)


def test_edges_where_a_cuda_path_gave_wrong_numbers(dev, monkeypatch):
    """Huge magnitudes, finite masks, reference mass the model rules out,
    a float64 reference, bad reference rows, negative rounding: the torch
    path gives the float64 reference's (and the core's) numbers."""
    from helpers import check_gpu_path_edges

    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    check_gpu_path_edges(dev)


def test_torch_path_accuracy_as_documented(dev, monkeypatch):
    """The torch path's stated accuracy (its module docstring): a Llama-3
    vocabulary, logits of std 1 to 10, against float64."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    g = torch.Generator().manual_seed(26)
    for scale in (1.0, 3.0, 10.0):
        z = torch.randn(24, 128256, generator=g) * scale
        r = z + torch.randn(24, 128256, generator=g) * 0.5
        t = torch.randint(0, 128256, (24,), generator=g)
        res = _engine.run(z.to(dev), t.to(dev), r.to(dev), nll=True, entropy=True, kl=True)
        zf, rf = z.double().numpy(), r.double().numpy()
        np.testing.assert_allclose(res.nll, ref_nll(zf, t.numpy()), rtol=0, atol=3e-5)
        np.testing.assert_allclose(res.kl, ref_kl(rf, zf), rtol=0, atol=3e-5)
        np.testing.assert_allclose(res.entropy, ref_entropy(zf), rtol=0, atol=1e-4)


def test_a_negative_view_is_read_as_its_values(dev):
    """A negative view (``is_neg()``, its memory holding the values negated)
    gives the numbers of the values it stands for on every CUDA path (the
    Triton kernel reads memory)."""
    z, r, t = _data(dev, shape=(3, 5), V=300, seed=9)
    t = t.clamp(min=0)  # every row counted (an ignored row's entropy is not computed)
    zn, rn = torch._neg_view(z), torch._neg_view(r)
    neg_z, neg_r = (-z).double().cpu().numpy(), (-r).double().cpu().numpy()
    res = _engine.run(zn, t, rn, nll=True, entropy=True, kl=True)
    np.testing.assert_allclose(res.nll, ref_nll(neg_z, t.cpu().numpy()).ravel(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(res.entropy, ref_entropy(neg_z).ravel(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(res.kl, ref_kl(neg_r, neg_z).ravel(), rtol=0, atol=2e-6)


def test_lazy_logits_on_the_cuda_path(dev, small_chunks):
    """projected() with tensors on the device: chunks of rows through the CUDA
    path, the numbers of the materialized logits on the native core."""
    g = torch.Generator().manual_seed(23)
    h = torch.randn(3, 11, 16, generator=g)
    w = torch.randn(1000, 16, generator=g) * 0.5
    t = torch.randint(0, 1000, (3, 11), generator=g)
    t[1, 2] = -100
    lazy = lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=4 * 1000 * 4)
    ref = lmmetrics.projected((h * 1.1).to(dev), w.to(dev))
    got = lmmetrics.evaluate(lazy, t.to(dev), shift=True, reference_logits=ref).as_dict()
    want = lmmetrics.evaluate((h @ w.T).numpy(), t.numpy(), shift=True,
                              reference_logits=((h * 1.1) @ w.T).numpy()).as_dict()
    for k, v in want.items():
        assert (got[k] is None) if v is None else got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    nll = lmmetrics.token_nll(lazy, t.to(dev))
    assert isinstance(nll, torch.Tensor) and nll.device.type == dev.type and nll.shape == (3, 11)


def test_lazy_logits_on_a_gpu_take_whole_rows_down_to_1024(dev, monkeypatch):
    """On the device, lazy rows are cut into vocabulary blocks only when
    fewer than 1024 whole rows fit the chunk (the host: 2048): 1100 fit,
    whole rows; 900 fit, blocks. The numbers are the materialized logits'."""
    from lmmetrics._engine import lazy as _lazy

    if dev.type == "cpu":  # (the chunk budget and the threshold are the device's)
        monkeypatch.setattr(_inputs, "is_cuda", lambda x: isinstance(x, torch.Tensor))
    g = torch.Generator().manual_seed(29)
    h, w = torch.randn(1500, 8, generator=g), torch.randn(1024, 8, generator=g)
    t = torch.randint(0, 1024, (1500,), generator=g)
    want = lmmetrics.token_nll((h @ w.T).numpy(), t.numpy())
    widths = []
    rows = _lazy.Projected.rows
    monkeypatch.setattr(_lazy.Projected, "rows", lambda self, i, cols=slice(None), *a: widths.append(
        len(range(*cols.indices(1024)))) or rows(self, i, cols, *a))
    for fit, whole in ((1100, True), (900, False)):
        old = lmmetrics.set_cuda_chunk_bytes(fit * 1024 * 4)
        try:
            widths.clear()
            got = lmmetrics.token_nll(lmmetrics.projected(h.to(dev), w.to(dev)), t.to(dev))
        finally:
            lmmetrics.set_cuda_chunk_bytes(old)
        assert (min(widths) == 1024) == whole, (fit, widths[:4])
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=2e-6, atol=2e-6)


def _recording_chunks(monkeypatch, module, events):
    """module's row_chunks, each chunk it yields recorded in events."""
    chunks = module.row_chunks

    def recorded(*a):
        for c in chunks(*a):
            events.append("chunk")
            yield c

    monkeypatch.setattr(module, "row_chunks", recorded)


def _same_outputs(got, want):
    """got has want's outputs: the integer ones equal, the others within
    the per-token contract (2e-6)."""
    for name in _request.OUTPUTS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if name in _request.INDEX_OUTPUTS and a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)
        elif a is not None:
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=name)


_ASKS = [dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, top_logprob=True),
         dict(nll=True), dict(argmax=True), dict(rank=True, nll=True), dict(rank=True), dict(entropy=True, kl=True)]


@pytest.mark.parametrize("ask", _ASKS, ids=lambda a: "+".join(a))
def test_a_pass_reads_the_device_once_when_it_ends(dev, small_chunks, monkeypatch, ask):
    """The torch path over many chunks: each chunk's values stay on the
    device, and cross to the host in one transfer (.cpu(), .numpy()) once
    every chunk is launched; nothing between chunks waits for the device.
    The numbers: the native core's, on the fast path, the exact path (argmax
    alone, the rank alone) and with ignored rows."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z, r, t = _data(dev, shape=(6, 13))
    zn, rn, tn = z.cpu().numpy(), r.cpu().numpy(), t.cpu().numpy()
    ref = r if "kl" in ask else None
    reads = HostReads(monkeypatch)
    with reads as events:
        _recording_chunks(monkeypatch, torch_path, events)
        got = _engine.run(z, tn, ref, **ask)
    assert events.count("chunk") > 2 and events == ["chunk"] * events.count("chunk") + ["cpu", "numpy"], events
    want = _engine.run(zn, tn, None if ref is None else rn, **ask)
    _same_outputs(got, want)
    assert got.n_counted == want.n_counted and got.nll_sum == pytest.approx(want.nll_sum, rel=1e-6)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "gathered"])
@pytest.mark.parametrize("triton_on", ["1", "0"], ids=["triton", "torch"])
def test_results_come_back_whole_or_gathered_alike(dev, monkeypatch, whole, triton_on):
    """A small pass's result buffer comes to the host whole (no gather on the
    device), a larger one's asked rows gathered first: the same values,
    errors and deferred Evaluator sums either way, on both paths."""
    monkeypatch.setenv("LMMETRICS_TRITON", triton_on)
    monkeypatch.setattr(_cuda, "_WHOLE_BYTES", 2**40 if whole else 0)
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or stack(*a, **k))
    z, r, t = _data(dev, shape=(5, 9))
    zn, rn, tn = z.cpu().numpy(), r.cpu().numpy(), t.cpu().numpy()
    for ask, ref in ((dict(nll=True), None), (dict(nll=True, entropy=True, argmax=True, rank=True), None),
                     (dict(kl=True, ref_nll=True, argmax=True, top_logprob=True), r)):
        got = _engine.run(z, t, ref, shift=False, **ask)
        want = _engine.run(zn, tn, None if ref is None else rn, shift=False, **ask)
        _same_outputs(got, want)
        np.testing.assert_array_equal(got.targets, want.targets)
        assert got.n_counted == want.n_counted and got.nll_sum == pytest.approx(want.nll_sum, rel=1e-6)
    bad = z.clone()
    bad[3, 2, 7] = math.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 29 \(position \(3, 2\)\)"):
        _engine.run(bad, t, nll=True, shift=False)
    ev = lmmetrics.Evaluator(shift=True, top_k=(1, 3))
    host = lmmetrics.Evaluator(shift=True, top_k=(1, 3))
    for k in range(2):
        ev.update(z[k:], t[k:])
        host.update(zn[k:], tn[k:])
    got = ev.compute().as_dict()
    for k, v in host.compute().as_dict().items():
        assert got[k] == (v if v is None else pytest.approx(v, rel=1e-6, abs=1e-6)), k
    assert (not stacks) == whole, stacks


def test_uncertified_rows_are_done_again_after_the_one_transfer(dev, small_chunks, monkeypatch):
    """A +inf row, a target at -inf and a NaN row: the chunks still go
    without a wait, the pass's values come back once, and only then are the
    chunks the fast path cannot certify done again by the exact path (a
    transfer per batch of those rows); the numbers and the error are the
    native core's."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z, r, t = _data(dev, shape=(6, 13))
    z[1, 3, 7] = math.inf
    z[4, 2, 11] = -math.inf
    t[4, 2] = 11
    zn, rn, tn = z.cpu().numpy(), r.cpu().numpy(), t.cpu().numpy()
    ask = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, rank=True, top_logprob=True)
    reads = HostReads(monkeypatch)
    with reads as events:
        _recording_chunks(monkeypatch, torch_path, events)
        got = _engine.run(z, tn, r, **ask)
    n = events.count("chunk")
    assert n > 2 and events[:n + 2] == ["chunk"] * n + ["cpu", "numpy"], events
    assert events[n + 2:] and events[n + 2:] == ["cpu", "numpy"] * ((len(events) - n - 2) // 2), events
    want = _engine.run(zn, tn, rn, **ask)
    assert got.nll[4 * 13 + 2] == math.inf
    for name in _request.OUTPUTS:
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-6, atol=2e-6, err_msg=name)
    z[5, 1, 0] = math.nan
    z[5, 7, 0] = math.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 66 "):
        _engine.run(z, tn, r, **ask)


@pytest.mark.parametrize("triton_on", ["0", "1"])
def test_lazy_logits_read_the_device_once(dev, monkeypatch, triton_on):
    """projected() over many chunks of whole rows: each chunk's values stay on
    the device, one transfer once every chunk is launched; a reference row
    holding +inf and a target at -inf are done again by the exact path after
    it (a transfer per batch of those rows). The numbers are those of the
    materialized logits on the native core; a NaN names its row."""
    monkeypatch.setenv("LMMETRICS_TRITON", triton_on)  # (Triton: on a GPU only; here the torch path)
    g = torch.Generator().manual_seed(29)
    V = 500  # whole rows a chunk (no vocabulary blocks)
    h = torch.randn(4, 9, 16, generator=g)
    w = torch.randn(V, 16, generator=g) * 0.5
    b = torch.zeros(V)
    b[7] = -math.inf
    t = torch.randint(0, V, (4, 9), generator=g)
    t[1, ::3] = -100
    t[2, 5] = 7
    r = (h @ w.T) * 1.1
    r[3, 2, 9] = math.inf
    ask = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, top_logprob=True)
    reads = HostReads(monkeypatch)
    take = _chunked._take_rows
    tn = t.numpy()
    for ref in (None, r):
        kw = dict(ask, kl=ref is not None, ref_nll=ref is not None)
        lazy = lmmetrics.projected(h.to(dev), w.to(dev), b.to(dev), chunk_bytes=3 * V * 4)
        rd = None if ref is None else ref.to(dev)
        with reads as events:
            monkeypatch.setattr(_chunked, "_take_rows", lambda *a: events.append("chunk") or take(*a))
            got = _engine.run(lazy, tn, rd, **kw)
        n = events.index("cpu")
        assert n > 6 and events[:n + 2] == ["chunk"] * n + ["cpu", "numpy"], events
        assert set(events[n + 2:]) <= {"chunk", "cpu", "numpy"} and events.count("numpy") == events.count("cpu")
        want = _engine.run((h @ w.T + b).numpy(), t.numpy(), None if ref is None else ref.numpy(), **kw)
        assert got.nll[2 * 9 + 5] == math.inf
        for name in _request.OUTPUTS:
            a, e = getattr(got, name), getattr(want, name)
            assert (a is None) == (e is None), name
            if a is not None:
                np.testing.assert_allclose(a, e, rtol=2e-6, atol=2e-6, err_msg=name)
        assert got.n_counted == want.n_counted and got.nll_sum == want.nll_sum
    h[3, 4, 0] = math.nan
    h[3, 6, 0] = math.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 31 "):
        _engine.run(lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=3 * V * 4), t.to(dev), nll=True)


def _tile_case(V=2000):
    """Lazy logits whose rows are split into vocabulary blocks at the budget
    of _tile_budget, a reference beside them, and targets: ignored rows, a
    model row holding +inf (an overflowing hidden state), a reference row
    holding +inf, a target at -inf (a masked column), a target at a block's
    first column and a tie across blocks."""
    g = torch.Generator().manual_seed(31)
    h = torch.randn(2, 30, 6, generator=g)
    w = torch.randn(V, 6, generator=g)
    w[100] *= 4
    w[1500] = w[100]  # a tie across blocks: the first index wins
    h[0, 3] = w[100]
    b = torch.zeros(V)
    b[7] = -math.inf
    t = torch.randint(0, V, (2, 30), generator=g)
    t[0, ::4] = -100
    t[1, 5] = 7        # its target's logit is -inf: NLL inf
    t[1, 8] = 600      # a block's first column
    t[0, 3] = 1500     # tied with the max at 100, in an earlier block: rank 1
    h[1, 11, 0] = 3e38  # overflows: +inf (and -inf) logits
    r = (h @ w.T + b) + torch.randn(2, 30, V, generator=g) * 0.3
    r[1, 11] = torch.randn(V, generator=g)
    r[0, 9, 1234] = math.inf
    return h, w, b, t, r


def _tile_budget(per_col):
    """A budget of 4 rows x 600 columns: rows of 2000 split into blocks."""
    return 4 * 600 * per_col


@pytest.mark.parametrize("with_ref", [False, True], ids=["logits", "with reference"])
def test_lazy_vocabulary_blocks_read_the_device_once(dev, monkeypatch, with_ref):
    """projected() with rows too wide for the budget (tiles of rows x a
    vocabulary block): the blocks' values stay and merge on the device, the
    pass's values cross to the host in one transfer once every tile is
    launched; the rows the blocks cannot certify (+inf logits, a target at
    -inf) are done again whole by the exact path after it. The numbers are
    those of the materialized logits on the native core; a NaN names its
    row (the first one), as does a reference row all -inf."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    h, w, b, t, r = _tile_case()
    ask = dict(nll=True, entropy=True, argmax=True, kl=with_ref, ref_nll=with_ref, rank=True, top_logprob=True)
    budget = _tile_budget(8 if with_ref else 4)
    tn = t.numpy()
    rd = r.to(dev) if with_ref else None
    reads = HostReads(monkeypatch)
    take = _chunked._take_rows
    tiles = []
    with reads as events:
        monkeypatch.setattr(_chunked, "_take_rows", lambda *a: events.append("tile") or tiles.append(a[3:4])
                            or take(*a))
        got = _engine.run(lmmetrics.projected(h.to(dev), w.to(dev), b.to(dev), chunk_bytes=budget), tn, rd, **ask)
    n = events.index("cpu")
    assert any(tiles[:n]) and n > 40, events  # vocabulary blocks, many of them
    assert events[:n + 2] == ["tile"] * n + ["cpu", "numpy"], events
    assert not any(tiles[n:]), tiles[n:]  # whole rows, redone: the +inf rows only (logits, reference)
    assert len(tiles[n:]) == (4 if with_ref else 1), tiles[n:]
    redo = events[n + 2:]
    assert redo and set(redo) <= {"tile", "cpu", "numpy"} and redo.count("numpy") == redo.count("cpu"), redo
    want = _engine.run((h @ w.T + b).numpy(), tn, r.numpy() if with_ref else None, **ask)
    assert got.nll[30 + 5] == math.inf and got.argmax[3] == 100 and got.rank[3] == 1
    _same_outputs(got, want)
    assert got.n_counted == want.n_counted
    c = tn.reshape(-1) >= 0
    c[30 + 5] = False  # (the inf)
    assert math.fsum(got.nll[c]) == pytest.approx(math.fsum(want.nll[c]), rel=1e-8)
    # a pass the blocks certify whole: that one transfer only
    with reads as events:
        _engine.run(lmmetrics.projected(h[:, 12:].to(dev), w.to(dev), chunk_bytes=budget), tn[:, 12:],
                    None if rd is None else rd[:, 12:], **ask)
    assert len(events) > 20 and events == ["tile"] * (len(events) - 2) + ["cpu", "numpy"], events
    if with_ref:  # a reference row all -inf, before a NaN row
        r_empty = r.clone()
        r_empty[1, 14] = -math.inf
        with pytest.raises(ValueError, match=r"reference_logits row 44 \(position \(1, 14\)\) is all -inf"):
            _engine.run(lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=budget), tn, r_empty.to(dev), **ask)
    h[1, 20, 1] = math.nan
    h[1, 25, 0] = math.nan
    with pytest.raises(ValueError, match=r"NaN in logits at row 50 \(position \(1, 20\)\)"):
        _engine.run(lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=budget), tn, rd, **ask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_lazy_vocabulary_blocks_in_every_dtype(dev, dtype):
    """The device merge of vocabulary blocks in each logits dtype: the
    native core's numbers on the same logits (computed whole), per token
    within the contract (float64: 1e-10), the NLL sum within 1e-8."""
    g = torch.Generator().manual_seed(5)
    V = 3000
    h = torch.randn(3, 40, 16, generator=g).to(dtype)
    w = (torch.randn(V, 16, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, (3, 40), generator=g)
    t[0, ::4] = -100
    ask = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, rank=True, top_logprob=True)
    lazy = lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=6 * 700 * 2 * h.element_size())
    lazy_ref = lmmetrics.projected((h * 0.8).to(dev), w.to(dev))
    got = _engine.run(lazy, t.numpy(), lazy_ref, **ask)
    whole = [x.rows(np.arange(120)).cpu() for x in (lazy, lazy_ref)]
    z, r = (x.float().numpy() if dtype == torch.bfloat16 else x.numpy() for x in whole)
    want = _engine.run(z, t.numpy().reshape(-1), r, **ask)
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    for name in _request.OUTPUTS:
        a, b = getattr(got, name), getattr(want, name)
        if name in _request.INDEX_OUTPUTS:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
    assert got.nll_sum == pytest.approx(want.nll_sum, rel=1e-8)


def _mask_at_block_starts(d, mask):
    """Lazy logits and reference with a finite mask (a bias on token 0 and
    every block's first column) split into vocabulary blocks, on device d,
    against the native core on the materialized logits."""
    g = torch.Generator().manual_seed(9)
    V, block = 2000, 500
    h = torch.randn(2, 20, 16, generator=g)
    w = torch.randn(V, 16, generator=g) * 0.5
    b = torch.zeros(V)
    b[::block] = mask
    t = torch.randint(0, V, (2, 20), generator=g)
    t[0, :3] = torch.tensor([0, 500, 1000])  # targets at the masks too
    ask = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True, top_logprob=True)
    budget = 4 * block * 8
    lazy = lmmetrics.projected(h.to(d), w.to(d), b.to(d), chunk_bytes=budget)
    lazy_ref = lmmetrics.projected((h * 0.9).to(d), w.to(d), b.to(d), chunk_bytes=budget)
    takes = []
    take = _chunked._take_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_chunked, "_take_rows", lambda *a: takes.append(a[3]) or take(*a))
        got = _engine.run(lazy, t.numpy(), lazy_ref, **ask)
    assert any(c is not None and c.stop - c.start <= block for c in takes)  # vocabulary blocks
    z, r = (h @ w.T + b).numpy(), ((h * 0.9) @ w.T + b).numpy()
    want = _engine.run(z, t.numpy(), r, **ask)
    _same_outputs(got, want)
    assert 1e3 < got.nll[0] < math.inf  # the target at a mask: its own NLL, finite


_MASKS = pytest.mark.parametrize("mask", [-1e4, -1e9, float(np.finfo(np.float32).min)], ids=["-1e4", "-1e9", "fmin"])


@_MASKS
def test_lazy_vocabulary_blocks_with_a_mask_at_a_block_start(dev, monkeypatch, mask):
    """A finite mask far below a row's max (a bias of -1e9 on token 0) at
    the first column of a vocabulary block, in the logits and in the
    reference: each block's logsumexp is taken from its own largest logit
    (the reference's: its NLL there), so the NLL, entropy, top
    log-probability, KL and reference NLL are the native core's on the
    materialized logits (a fixed first column cancelled them ~1 nat off)."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    _mask_at_block_starts(dev, mask)


@_MASKS
def test_host_vocabulary_blocks_with_a_mask_at_a_block_start(mask):
    """The same on the host (the native core on each tile)."""
    _mask_at_block_starts(torch.device("cpu"), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_target_far_below_its_row_max(dev, monkeypatch, dtype):
    """A target 6e38 below its row's max (-3e38 in a row of 3e38): its NLL
    is finite in float64, as the native core gives it; the exact path
    works in float64 (in float32 the difference was -inf, the NLL inf),
    with a reference too (KL: the exact path for the Triton kernel)."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z = torch.full((3, 8), 3e38)
    z[0, 1] = z[2, 3] = -3e38
    z[1, 2] = 1e38
    t = torch.tensor([1, 0, 3])
    z = z.to(dtype)
    zn = z.float().numpy()
    for ref in (None, z):
        got = _engine.run(z.to(dev), t.numpy(), None if ref is None else ref.to(dev), nll=True, entropy=True,
                          kl=ref is not None, ref_nll=ref is not None)
        want = _engine.run(zn, t.numpy(), None if ref is None else zn, nll=True, entropy=True, kl=ref is not None,
                           ref_nll=ref is not None)
        assert np.isfinite(got.nll).all() and got.nll[0] > 5e38
        _same_outputs(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_a_metric_softcap_on_vocabulary_blocks(dev, dtype):
    """softcap= on lazy logits split into vocabulary blocks: capped in
    float32 (float64 for float64 logits), as whole rows are, not in the
    logits' 16-bit dtype (0.11 nats off at V = 256000) or in float32 for
    float64 (KL 1e-7 off)."""
    g = torch.Generator().manual_seed(4)
    V = 3000
    h = torch.randn(2, 12, 16, generator=g).to(dtype)
    w = (torch.randn(V, 16, generator=g) * 3).to(dtype)
    r = (torch.randn(2, 12, V, generator=g) * 20).to(dtype)
    t = torch.randint(0, V, (2, 12), generator=g)
    ask = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True)
    lazy = lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=4 * 700 * 2 * h.element_size())
    got = _engine.run(lazy, t.numpy(), r.to(dev), softcap=30.0, **ask)
    z = lazy.rows(np.arange(24)).cpu()
    z, rn = (x.double().numpy() for x in (z, r.reshape(24, V)))
    want = _engine.run(np.tanh(z / 30) * 30, t.numpy().reshape(-1), np.tanh(rn / 30) * 30, **ask)
    tol = 1e-10 if dtype == torch.float64 else 2e-5  # (the torch path's accuracy: its docstring)
    for name in ("nll", "entropy", "kl", "ref_nll"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=tol, atol=tol, err_msg=name)


def _batches(dev, n=3, shape=(3, 17), V=600):
    return [tuple(x.to(dev) for x in _data(torch.device("cpu"), shape=shape, V=V, seed=40 + k)) for k in range(n)]


def test_an_evaluator_on_a_device_waits_for_it_only_when_read(dev, monkeypatch):
    """Evaluator.update on CUDA tensors (targets on the device, shift=True
    views) launches the batch's pass and reads nothing on the host; the
    next update adds that batch (its one transfer) before launching its
    own, and a read adds the last; the numbers are the host's. One batch
    at most waits (its logits held until then)."""
    batches = _batches(dev)
    ev = lmmetrics.Evaluator(shift=True, top_k=(1, 5), calibration_bins=10)
    reads = HostReads(monkeypatch)
    with reads as events:
        for k, (z, r, t) in enumerate(batches):
            ev.update(z, t, reference_logits=r)
            assert events == _deferred_read(dev) * k and "updates_pending=1" in repr(ev), (k, events, repr(ev))
        got = ev.compute().as_dict()
    assert events == _deferred_read(dev) * 3, events
    want = lmmetrics.Evaluator(shift=True, top_k=(1, 5), calibration_bins=10)
    for z, r, t in batches:
        want.update(z.cpu().numpy(), t.cpu().numpy(), reference_logits=r.cpu().numpy())
    for k, v in want.compute().as_dict().items():
        if not isinstance(v, (lmmetrics.Calibration, type(None))):
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert "pending" not in repr(ev)
    # pickling and deep copies add the batch not yet added first
    import copy
    import pickle

    ev.update(*batches[0][::2])
    for twin in (copy.deepcopy(ev), pickle.loads(pickle.dumps(ev))):
        assert twin.compute().tokens == ev.compute().tokens == got["tokens"] + 3 * 16 - 10


def test_a_target_out_of_range_is_named_in_the_unshifted_targets(dev):
    """shift=True on the device: the pass reads targets[..., 1:] there, and
    an out-of-range target is named at its index in the targets given, at
    once and from an Evaluator's deferred pass alike."""
    z, _, t = _data(dev, shape=(3, 9), V=600)
    t[2, 7] = 600
    want = r"target 600 at position \(2, 7\) is out of range for a vocabulary of 600"
    with pytest.raises(ValueError, match=want):
        lmmetrics.cross_entropy(z, t, shift=True)
    ev = lmmetrics.Evaluator(shift=True)
    ev.update(z, t)
    with pytest.raises(ValueError, match=r"^update 1 of this Evaluator .*" + want):
        ev.compute()


def test_an_error_found_on_the_device_is_raised_when_the_sums_are_read(dev):
    """A NaN row or a target out of range in a batch whose pass was not
    waited for: raised at the next read (compute, state_dict, all_reduce,
    merge), naming the update and the row; that batch is not added, the
    others are; load_state_dict and reset drop a batch not yet added."""
    batches = _batches(dev)
    z, r, t = (x.clone() for x in batches[1])
    z[1, 4, 7] = math.nan
    t[1, 4] = t[1, 4].abs()  # counted
    bad_target = t.clone()
    bad_target[2, 3] = 600
    for read in ("compute", "state_dict", "all_reduce", "merge"):
        ev = lmmetrics.Evaluator()
        ev.update(*batches[0][::2])
        ev.update(z, t)
        ev.update(*batches[2][::2])  # (adds update 2: keeps its error for the read)
        with pytest.raises(ValueError, match=r"^update 2 of this Evaluator .*NaN in logits at row 21 "
                                             r"\(position \(1, 4\)\)"):
            getattr(ev, read)(*([lmmetrics.Evaluator()] if read == "merge" else []))
        alone = lmmetrics.Evaluator()
        for zz, _, tt in (batches[0], batches[2]):
            alone.update(zz.cpu().numpy(), tt.cpu().numpy())
        got, want = ev.state_dict(), alone.state_dict()
        assert got.pop("settings") == want.pop("settings")
        assert got == pytest.approx(want, rel=1e-6) and got["tokens"] == want["tokens"], read
    ev = lmmetrics.Evaluator()  # an error kept for the next read survives pickling
    ev.update(z, t)
    import pickle

    with pytest.raises(ValueError, match=r"^update 1 of this Evaluator .*NaN in logits at row 21"):
        pickle.loads(pickle.dumps(ev)).compute()
    ev = lmmetrics.Evaluator()
    ev.update(batches[0][0], bad_target)
    ev.update(z, t)
    with pytest.raises(ValueError, match=r"^update 1 of this Evaluator .*1 later update\(s\) failed too.*: "
                                         r"target 600 at position \(2, 3\) is out of range"):
        ev.compute()
    assert ev.compute().tokens == 0
    # a call that raised at once counts: the update named is the user's count of calls
    ev.reset()
    ev.update(*batches[0][::2])
    with pytest.raises(ValueError, match="shape"):
        ev.update(z, t[:, :3])
    ev.update(z, t)
    with pytest.raises(ValueError, match=r"^update 3 of this Evaluator .*NaN in logits at row 21"):
        ev.compute()
    for drop in ("reset", "load_state_dict"):
        ev.update(z, t)
        getattr(ev, drop)(*([lmmetrics.Evaluator().state_dict()] if drop == "load_state_dict" else []))
        assert ev.compute().tokens == 0 and "pending" not in repr(ev)
    # a one-call function raises in the call, as on the host
    with pytest.raises(ValueError, match=r"^NaN in logits at row 21"):
        lmmetrics.evaluate(z, t)


def test_the_first_bad_row_is_named_when_an_earlier_row_is_redone(dev):
    """A row the fast path cannot certify (+inf, or the torch path's chunk
    with a NaN) is redone before a later row's error is raised: its own
    error, if it comes first, is the one named, as the core names it."""
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):  # (float64: the torch path)
        z = torch.randn(4, 600, generator=g, dtype=dtype)
        t = torch.randint(0, 600, (4,), generator=g)
        z[0, 3] = math.inf
        z[0, 500] = math.nan
        z[2, 7] = math.nan
        for tt in (t, torch.where(torch.arange(4) == 2, 600, t)):
            with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
                _engine.run(z.numpy(), tt.numpy(), nll=True)
            with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
                _engine.run(z.to(dev), tt.to(dev), nll=True)
        # the row's reference bad too (a NaN, all -inf): the logits' NaN,
        # which +inf hides from the fast path's flags, is named first
        r = torch.randn(4, 600, generator=g, dtype=dtype)
        r[0, 50] = math.nan
        for ref in (r, torch.where(torch.arange(4)[:, None] == 0, -math.inf, r)):
            with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
                _engine.run(z.numpy(), t.numpy(), ref.numpy(), nll=True, kl=True)
            with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
                _engine.run(z.to(dev), t.to(dev), ref.to(dev), nll=True, kl=True)
    # lazy logits (chunks of whole rows): a row with +inf and NaN (0 * inf)
    # before a row with NaN; either side lazy
    h, w = inf_and_nan_head(300, 4, bad=0, nan_row=2)
    t = torch.randint(0, 300, (4,), generator=g)
    with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
        _engine.run((h @ w.T).numpy(), t.numpy(), nll=True)
    for budget in (300 * 4, None):
        lazy = lmmetrics.projected(h.to(dev), w.to(dev), chunk_bytes=budget)
        with pytest.raises(ValueError, match=r"^NaN in logits at row 0"):
            _engine.run(lazy, t.to(dev), nll=True)
        with pytest.raises(ValueError, match=r"^NaN in reference_logits at row 0"):
            _engine.run(torch.zeros(4, 300).to(dev), t.to(dev), lazy, nll=True, kl=True)


def test_torchmetrics_classes_on_a_device_wait_for_it_only_when_computed(dev, monkeypatch):
    """The torchmetrics classes: the first update waits (a MetricCollection
    groups metrics by their states after it), later ones add the batch
    before theirs; compute, forward, state_dict and clone see every batch;
    an error is raised at compute, and the other batches stay counted."""
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection

    from lmmetrics.torchmetrics import LanguageModelMetrics, Perplexity

    batches = _batches(dev)
    metric = LanguageModelMetrics()
    ppl = Perplexity()
    reads = HostReads(monkeypatch)
    with reads as events:
        for k, (z, _, t) in enumerate(batches):
            metric.update(z, t)
            ppl.update(z, t)
            assert events == _deferred_read(dev) * 2 * max(1, k), (k, events)
    want = lmmetrics.Evaluator(ignore_index=None)
    for z, _, t in batches:
        want.update(z.cpu().numpy(), t.cpu().numpy())
    want = want.compute()
    clone = metric.clone()
    got = metric.compute()
    assert float(got["loss"]) == pytest.approx(want.loss, rel=1e-6)
    assert float(got["tokens"]) == want.tokens and float(ppl.compute()) == pytest.approx(want.perplexity, rel=1e-6)
    assert float(clone.compute()["tokens"]) == want.tokens
    # forward: the batch's value, the batches before it kept
    batch_value = metric(*batches[0][::2])
    assert 0 < float(batch_value["tokens"]) < want.tokens
    assert float(metric.compute()["tokens"]) == want.tokens + float(batch_value["tokens"])
    # grouped by what they compute, not by states still empty
    ig = int(batches[0][2][0, 1])
    group = MetricCollection({"p": Perplexity(), "p_ig": Perplexity(ignore_index=ig), "lm": LanguageModelMetrics()})
    for z, _, t in batches:
        group.update(z, t)
    values = group.compute()
    ignored = lmmetrics.Evaluator(ignore_index=ig)
    for z, _, t in batches:
        ignored.update(z.cpu().numpy(), t.cpu().numpy())
    assert float(values["p"]) == pytest.approx(want.perplexity, rel=1e-6)
    assert float(values["p_ig"]) == pytest.approx(ignored.compute().perplexity, rel=1e-6)
    # a compute group (metrics whose states agree after the first update share its first member's): every
    # member sees the last batch, which that member's update left to wait (they missed it)
    group = MetricCollection({"a": Perplexity(), "b": Perplexity(),
                              "x": LanguageModelMetrics(prefix="x/"), "y": LanguageModelMetrics(prefix="y/")})
    for z, _, t in batches:
        group.update(z, t)
    assert sorted(map(sorted, group.compute_groups.values())) == [["a", "b"], ["x", "y"]]  # (the case)
    with reads as events:
        group.update(*batches[0][::2])   # (a group's update waits for its batch: its states are shared at once)
        assert events.count("numpy") >= 2, events
    group.update(*batches[1][::2])
    single = group.clone()
    values = group.compute()
    twice = lmmetrics.Evaluator(ignore_index=None)
    for z, _, t in batches + batches[:2]:
        twice.update(z.cpu().numpy(), t.cpu().numpy())
    twice = twice.compute()
    for key in ("a", "b"):
        assert float(values[key]) == pytest.approx(twice.perplexity, rel=1e-6), key
        assert float(single[key].compute()) == pytest.approx(twice.perplexity, rel=1e-6), key
    for key in ("x/", "y/"):
        assert float(values[key + "tokens"]) == twice.tokens, key
    # an error at compute; the other batches stay
    metric.reset()
    z, _, t = (x.clone() for x in batches[1])
    z[0, 0, 0] = math.nan
    t[0, 0] = 1
    for zz, tt in ((batches[0][0], batches[0][2]), (z, t), (batches[2][0], batches[2][2])):
        metric.update(zz, tt)
    with pytest.raises(ValueError, match=r"^update 2 of this Evaluator since it was made or reset .*NaN in logits "
                                         r"at row 0"):
        metric.compute()
    both = lmmetrics.Evaluator(ignore_index=None)
    for zz, _, tt in (batches[0], batches[2]):
        both.update(zz.cpu().numpy(), tt.cpu().numpy())
    assert float(metric.compute()["tokens"]) == both.compute().tokens


def test_torchmetrics_states_read_whole_and_only_when_read(dev, monkeypatch):
    """The states a torchmetrics class holds are read with every batch in
    them, and only a read of the metric waits: a module walk (hash:
    ``model.train()``, ``zero_grad()``) and ``compute_on_cpu`` do not wait
    (nor raise a waiting batch's error); ``copy.copy`` shares no state; a
    metric pickled with its states among its attributes loads; loading its
    states drops a batch left to wait, loading a model's weights does not."""
    import copy
    import pickle

    pytest.importorskip("torchmetrics")
    from lmmetrics.torchmetrics import Perplexity

    batches = _batches(dev)
    model = torch.nn.Module()
    model.metric = Perplexity(compute_on_cpu=True)
    model.layer = torch.nn.Linear(2, 2)
    for z, _, t in batches:
        model.metric.update(z, t)
    want = lmmetrics.Evaluator(ignore_index=None)
    for z, _, t in batches:
        want.update(z.cpu().numpy(), t.cpu().numpy())
    reads = HostReads(monkeypatch)
    with reads as events:
        model.train()
        model.zero_grad()
        list(model.parameters())
        hash(model.metric)
        model.metric.to(dev)   # (Lightning's self.log(name, metric) does this every step)
        assert events == [], events
    # a copy's states hold the batch left to wait (the copy adds it: a read)
    for twin in (copy.deepcopy(model.metric), pickle.loads(pickle.dumps(model.metric))):
        assert float(twin.tokens) == float(model.metric.tokens) == want.compute().tokens
    assert float(model.metric.compute()) == pytest.approx(want.compute().perplexity, rel=1e-6)
    # a waiting batch's error: raised by the metric's read, not by a module walk
    z, _, t = (x.clone() for x in batches[1])
    z[0, 0, 0] = math.nan
    t[0, 0] = 1
    bad = Perplexity()
    bad.update(*batches[0][::2])
    bad.update(z, t)
    torch.nn.ModuleList([bad]).train()
    with pytest.raises(ValueError, match="NaN in logits"):
        bad.compute()
    # copy.copy: its own states, and its own batch left to wait
    a = Perplexity()
    a.update(*batches[0][::2])
    b = copy.copy(a)
    before = float(b.compute())
    a.update(*batches[1][::2])
    assert float(b.compute()) == before != float(a.compute())
    a.update(*batches[2][::2])              # (left to wait in a)
    b = copy.copy(a)
    assert float(b.compute()) == float(a.compute()) == float(copy.copy(a).compute())
    # a metric pickled with its states among its attributes (as before they were held apart)
    state = a.__getstate__()
    old = {k: v for k, v in state.items() if k != "_held"}
    old.update(state["_held"])
    back = pickle.loads(pickle.dumps(a))
    back.__setstate__(old)
    assert float(back.compute()) == float(a.compute())
    # load_state_dict: a waiting batch is dropped when the states are loaded, kept when they are not
    first = Perplexity()
    first.update(*batches[0][::2])
    first.persistent(True)
    saved = first.state_dict()
    m = Perplexity()
    m.persistent(True)
    for z, _, t in batches[1:]:
        m.update(z, t)
    m.load_state_dict(saved)
    assert float(m.compute()) == pytest.approx(float(first.compute()), rel=1e-12)
    holder = torch.nn.Module()
    holder.metric, holder.layer = Perplexity(), torch.nn.Linear(2, 2)
    for z, _, t in batches:
        holder.metric.update(z, t)
    holder.load_state_dict({"layer." + k: v for k, v in holder.layer.state_dict().items()})   # weights only
    assert float(holder.metric.compute()) == pytest.approx(want.compute().perplexity, rel=1e-6)


def test_inference_mode_tensors(dev):
    """Tensors made under torch.inference_mode() (Lightning's validate and
    test) track no version counter: reading it raised, and every pass on
    the device failed there."""
    pytest.importorskip("torchmetrics")
    from lmmetrics.torchmetrics import Perplexity

    z, _, t = _batches(dev)[0]
    want = lmmetrics.evaluate(z.cpu().numpy(), t.cpu().numpy())
    with torch.inference_mode():
        zi, ti = z.clone(), t.clone()
        assert lmmetrics.evaluate(zi, ti).loss == pytest.approx(want.loss, rel=1e-6)
        ev = lmmetrics.Evaluator()
        ev.update(zi, ti)
        metric = Perplexity()
        metric.update(zi, ti)
        metric.update(zi, ti)
    assert ev.compute().loss == pytest.approx(want.loss, rel=1e-6)
    assert float(metric.compute()) == pytest.approx(want.perplexity, rel=1e-6)


def test_a_collection_does_not_group_what_means_another_thing(dev):
    """A MetricCollection groups metrics whose states agree after the first
    update: a first batch that counts nothing left every class's sums at 0,
    and Perplexity, BitsPerByte and LanguageModelMetrics shared one state
    (Perplexity raised, the entropy was 0). Each class and setting is now
    told apart; alike ones still share."""
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection

    from lmmetrics.torchmetrics import BitsPerByte, LanguageModelMetrics, Perplexity

    batches = _batches(dev)
    table = torch.arange(600) % 4
    empty = batches[0][2].clone().fill_(-100)
    group = MetricCollection({"ppl": Perplexity(), "ppl2": Perplexity(), "bpb": BitsPerByte(table),
                              "lm": LanguageModelMetrics(token_bytes=table)})
    group.update(batches[0][0], empty)
    for z, _, t in batches[1:]:
        group.update(z, t)
    assert sorted(map(sorted, group.compute_groups.values())) == [["bpb"], ["lm"], ["ppl", "ppl2"]]
    got = group.compute()
    want = lmmetrics.Evaluator(ignore_index=None, token_bytes=table.numpy())
    for z, _, t in batches[1:]:
        want.update(z.cpu().numpy(), t.cpu().numpy())
    want = want.compute()
    assert float(got["ppl"]) == float(got["ppl2"]) == pytest.approx(want.perplexity, rel=1e-6)
    assert float(got["bpb"]) == pytest.approx(want.bits_per_byte, rel=1e-6)
    assert float(got["entropy"]) == pytest.approx(want.entropy, rel=1e-6)


def test_targets_read_on_the_device_come_back_exact(dev):
    """The targets a pass reads on the device come back as given, an ignored
    ignore_index beyond float64's integers included (2^53 + 1)."""
    ig = 2**53 + 1
    z = torch.randn(4, 50).to(dev)
    t = torch.tensor([1, ig, -5, 49]).to(dev)
    got = _engine.run(z, t, ignore_index=ig, nll=True)
    assert got.targets.tolist() == [1, ig, -5, 49] and got.counted.tolist() == [True, False, False, True]
    want = _engine.run(z.cpu().numpy(), t.cpu().numpy(), ignore_index=ig, nll=True)
    np.testing.assert_allclose(got.nll, want.nll, rtol=2e-6, atol=2e-6)


def test_logits_changed_before_their_batch_is_added_are_refused(dev):
    """A batch waiting to be added holds its logits: a row with +inf is read
    again when it is; logits changed in place before then are an error,
    not a number from other logits."""
    z, _, t = _batches(dev, n=1)[0]
    z[0, 0, 5] = math.inf
    t[0, 0] = 5
    ev = lmmetrics.Evaluator()
    ev.update(z, t)
    z.fill_(0.0)
    with pytest.raises(ValueError, match=r"^update 1 .*changed in place before it completed"):
        ev.compute()
    ev.update(z, t)  # unchanged after its update: added
    assert ev.compute().tokens == int((t.cpu() >= 0).sum())


@pytest.mark.parametrize("triton_on", ["0", "1"], ids=["torch", "triton-on-a-gpu"])
def test_sync_false_waits_for_nothing_until_read(dev, monkeypatch, triton_on):
    """cross_entropy, perplexity and bits_per_token with sync=False launch
    the pass and return, reading nothing on the host (nor does ``.value``,
    computed on the device); ``float()`` reads once and equals the
    synchronous call bit for bit, and float64 torch; shift=True with
    Hugging Face labels."""
    monkeypatch.setenv("LMMETRICS_TRITON", triton_on)  # (routed CPU tensors: the torch path either way)
    z, _, t = _data(dev, shape=(3, 11))
    labels = t.clone()
    labels[:, 0] = 5
    ref = F.cross_entropy(z[:, :-1].double().reshape(-1, z.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    ref_sum = F.cross_entropy(z[:, :-1].double().reshape(-1, z.shape[-1]), labels[:, 1:].reshape(-1),
                              ignore_index=-100, reduction="sum")
    cases = [(lmmetrics.cross_entropy, {}, float(ref)), (lmmetrics.cross_entropy, {"reduction": "sum"}, float(ref_sum)),
             (lmmetrics.perplexity, {}, math.exp(ref)), (lmmetrics.bits_per_token, {}, float(ref) / math.log(2))]
    reads = HostReads(monkeypatch)
    for fn, kw, want in cases:
        with reads as events:
            d = fn(z, labels, shift=True, sync=False, **kw)
            value = d.value
            assert events == [] and "pending" in repr(d), (fn, events)
            got = float(d)
            assert events == _deferred_read(dev), events
        assert isinstance(d, lmmetrics.Deferred) and got == d.item() == d.result()
        assert f"{d:.6f}" == f"{got:.6f}" and f"{d}" == str(d) == f"Deferred({got!r})"
        assert got == fn(z, labels, shift=True, **kw)  # (the synchronous call's bits)
        assert got == pytest.approx(want, rel=2e-6)  # (float32 logits: 2e-6 a token)
        assert value.dtype == torch.float64 and value.shape == () and value.device == z.device
        assert float(value.cpu()) == pytest.approx(got, rel=1e-12), fn
        assert d.value is value and repr(d) == f"Deferred({got!r})"


def test_device_value_read_on_another_stream(monkeypatch):
    """`cuda.device_total` on a pass queued on one stream and read on
    another (stand-in streams: the branch a GPU takes): computed on the
    pass's stream, then the reader's stream waits for it and the result's
    memory is kept for the reader; read on the pass's own stream, neither."""
    import contextlib

    entered, waits, recorded = [], [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    def on(stream):
        entered.append(stream.name)
        return contextlib.nullcontext()

    pass_stream, reader = Stream("pass"), Stream("reader")
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s.name))
    res = torch.zeros(layout.N_RESULTS, 3, dtype=torch.float64)
    res[layout.RES_FLAGS] = torch.tensor([layout.F_COUNTED, 0, layout.F_COUNTED], dtype=torch.float64)
    res[layout.row("nll")] = torch.tensor([1.0, 7.0, 2.5], dtype=torch.float64)
    for current, want_waits in ((reader, [("reader", "pass")]), (pass_stream, [])):
        entered.clear(), waits.clear(), recorded.clear()
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None, s=current: s)
        value = _cuda.device_total((res, pass_stream), "nll", lambda total, n: total / n)
        assert float(value) == 1.75 and entered == ["pass"]
        assert waits == want_waits and recorded == [name for name, _ in want_waits]


def test_sync_false_raises_when_read(dev, monkeypatch):
    """A bad row or target found by a pass launched with sync=False: the call
    returns, ``.value`` is NaN, and every ``float()`` raises what the
    synchronous call raises (named in the unshifted inputs); a row of +inf
    logits: ``.value`` NaN, ``float()`` the exact path's value."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z, _, t = _data(dev, shape=(3, 11))
    bad = z.clone()
    bad[1, 4, 9] = math.nan
    d = lmmetrics.cross_entropy(bad, t, shift=True, sync=False)
    assert torch.isnan(d.value)
    with pytest.raises(ValueError, match=r"NaN in logits at row 15 \(position \(1, 4\)\)") as first:
        lmmetrics.cross_entropy(bad, t, shift=True)
    for _ in range(2):
        with pytest.raises(ValueError) as e:
            float(d)
        assert str(e.value) == str(first.value)
    assert "error=" in repr(d)
    far = t.clone()
    far[2, 6] = 5000
    d = lmmetrics.perplexity(z, far, shift=True, sync=False)
    assert torch.isnan(d.value)
    with pytest.raises(ValueError, match=r"target 5000 at position \(2, 6\)"):
        d.item()
    inf = z.clone()
    inf[0, 2, 3] = math.inf
    t2 = t.clone()
    t2[0, 2] = 3
    d = lmmetrics.cross_entropy(inf, t2, sync=False)
    assert torch.isnan(d.value)
    want = lmmetrics.cross_entropy(inf.cpu().numpy(), t2.cpu().numpy())
    assert float(d) == lmmetrics.cross_entropy(inf, t2) == pytest.approx(want, rel=2e-6) and math.isfinite(want)


def test_sync_false_on_the_host_and_its_misuse():
    """Logits computed on the host with sync=False: done in the call (its
    errors raised there), the value held; reduction='none' and a sync that
    is not a bool are errors."""
    z = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    t = np.array([1, 2, -100, 39, 0])
    want = float(F.cross_entropy(torch.from_numpy(z).double(), torch.from_numpy(t), ignore_index=-100))
    d = lmmetrics.cross_entropy(z, t, sync=False)
    assert float(d) == pytest.approx(want, rel=2e-6) and type(d.value) is np.float64 and d.value == float(d)
    dt = lmmetrics.cross_entropy(torch.from_numpy(z), torch.from_numpy(t), sync=False)
    assert dt.value.dtype == torch.float64 and float(dt.value) == float(d)
    z[3, 5] = np.nan
    with pytest.raises(ValueError, match="NaN in logits at row 3"):
        lmmetrics.cross_entropy(z, t, sync=False)
    with pytest.raises(ValueError, match="reduction='none'"):
        lmmetrics.cross_entropy(z, t, reduction="none", sync=False)
    with pytest.raises(TypeError, match="sync must be True or False"):
        lmmetrics.perplexity(z, t, sync="no")


def test_a_read_interrupted_while_a_pass_completes_is_done_again(dev, monkeypatch):
    """A read of a pass not waited for that is interrupted (Ctrl-C during
    the wait: KeyboardInterrupt once the device returns) leaves it to
    complete at the next read: ``float(d)`` then gives the synchronous
    call's value, or raises its error, and an Evaluator adds the batch,
    where the interrupted read had left the results unfilled (a Deferred
    read 0.0, an Evaluator added empty arrays)."""
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z, _, t = _data(dev, shape=(3, 11))
    settle = _cuda.settle
    interrupts = []

    def interrupted_once(*a, **k):
        if not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt
        return settle(*a, **k)

    bad = z.clone()
    bad[1, 4, 9] = math.nan
    with pytest.raises(ValueError) as first:
        lmmetrics.cross_entropy(bad, t, shift=True)
    good = lmmetrics.cross_entropy(z, t, shift=True)
    whole = lmmetrics.Evaluator(shift=True)
    whole.update(z, t)
    whole = whole.compute().as_dict()
    monkeypatch.setattr(_cuda, "settle", interrupted_once)
    for logits, want in ((z, good), (bad, first.value)):
        interrupts.clear()
        d = lmmetrics.cross_entropy(logits, t, shift=True, sync=False)
        with pytest.raises(KeyboardInterrupt):
            float(d)
        assert repr(d) == "Deferred(pending)"
        if isinstance(want, float):
            assert float(d) == want and math.isfinite(want)
        else:
            with pytest.raises(ValueError) as e:
                float(d)
            assert str(e.value) == str(want)
    interrupts.clear()
    ev = lmmetrics.Evaluator(shift=True)
    ev.update(z, t)
    with pytest.raises(KeyboardInterrupt):
        ev.compute()
    assert ev.compute().as_dict() == whole and whole["loss"] == pytest.approx(good, rel=1e-12)


def test_a_deferred_dropped_unread_frees_its_pass(dev):
    """A Deferred dropped without ``float()`` (its ``.value`` kept, as a
    training loop logs it) frees its pass at once, the logits it holds for
    the exact path with it: no reference cycle left for the garbage
    collector (on a GPU, one batch of logits held a step)."""
    import gc
    import weakref

    z, _, t = _data(dev, shape=(3, 11))
    gc.collect()
    gc.disable()
    try:
        for shift in (False, True):
            d = lmmetrics.cross_entropy(z, t, shift=shift, sync=False)
            value = d.value
            held = weakref.ref(d._res)
            del d
            assert held() is None, shift
            assert float(value) == pytest.approx(lmmetrics.cross_entropy(z, t, shift=shift), rel=1e-12)
    finally:
        gc.enable()


def test_a_deferred_read_from_two_threads_at_once(dev, monkeypatch):
    """float(d) from two threads at once: one completes the pass, the other
    waits for its value. Both filled the same results: the second's fast
    values (NaN for a row of +inf logits) overwrote the first's exact ones
    after the first redid that row, and the first read NaN (here the
    second thread is let in between the two, where it could come in)."""
    import threading

    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    z, _, t = _data(dev, shape=(3, 11))
    z[0, 2] = 0.0
    z[0, 2, 3] = math.inf
    t[0, 2] = 3
    want = lmmetrics.cross_entropy(z, t)
    assert math.isfinite(want)
    exact = _cuda.exact_rows
    second_in = threading.Event()
    calls = []

    def exact_rows(*a):
        calls.append(1)
        if len(calls) == 1:  # the first thread: its row redone, then the second thread's fast values
            exact(*a)
            second_in.wait(timeout=1.0)
        else:
            second_in.set()
            time.sleep(0.3)
            exact(*a)

    monkeypatch.setattr(_cuda, "exact_rows", exact_rows)
    d = lmmetrics.cross_entropy(z, t, sync=False)
    got = []
    threads = [threading.Thread(target=lambda: got.append(float(d))) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert got == [want, want] and float(d) == want, (got, want)
    assert len(calls) == 1  # (the pass completed once)
    import copy

    assert float(copy.deepcopy(d)) == float(copy.copy(d)) == want  # (a copy has a lock of its own)


def test_sync_as_a_bool_variable_has_an_overload():
    """``sync=flag`` with flag a ``bool`` (not a literal) matches an overload
    of each function taking sync (float or Deferred), as a type checker sees
    it: with the literal overloads only, mypy found no variant for it."""
    import typing

    for fn in (lmmetrics.cross_entropy, lmmetrics.perplexity, lmmetrics.bits_per_token):
        plain = [o for o in typing.get_overloads(fn) if o.__annotations__.get("sync") == "bool"
                 and o.__annotations__["return"] == "Union[float, Deferred]"]
        assert plain, fn.__name__


def test_a_failed_pass_kept_to_raise_later_lets_its_logits_go(dev):
    """A Deferred whose read raised keeps its error for the later reads, and
    an Evaluator the error of a batch it has drained for its next read, not
    the logits: the error's traceback (and, with shift=True, that of the
    error it was renamed from) held the frames of the pass that found it,
    their logits with them (on a GPU, a batch of logits kept as long as the
    Deferred is, or until the Evaluator is read). Every read still raises
    the same message."""
    import gc

    def held(ptr):
        gc.collect()
        # (type(), not isinstance: isinstance asks a deprecated lazy object of torch.distributed its
        # __class__, which warned)
        return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.data_ptr() == ptr]

    z, _, t = _data(dev, shape=(3, 11))
    for shift in (False, True):
        bad = z.clone()
        bad[1, 2, 9] = math.nan
        ptr = bad.data_ptr()
        d = lmmetrics.cross_entropy(bad, t, shift=shift, sync=False)
        ev = lmmetrics.Evaluator(shift=shift)
        ev.update(bad, t)
        del bad
        ev.update(z, t)  # (the failed batch drained, its error kept)
        with pytest.raises(ValueError, match=r"NaN in logits at row 13 ") as first:
            float(d)
        del first
        assert held(ptr) == [], shift
        with pytest.raises(ValueError, match=r"NaN in logits at row 13 "):
            float(d)
        with pytest.raises(ValueError, match=r"^update 1 .*NaN in logits at row 13 "):
            ev.compute()
