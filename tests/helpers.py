"""What the tests share: the float64 references they compare with, the
dtypes and SIMD paths they run over. A plain module beside the tests
(conftest.py puts this folder on sys.path, so that it imports the same way
under pytest's prepend and importlib modes and in worker subprocesses)."""
import json
import math
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from lmmetrics import _core

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

# bfloat16 without ml_dtypes: a visible skip, not a case that silently vanishes
BF16_PARAM = BF16 if BF16 is not None else pytest.param(
    None, marks=pytest.mark.skip(reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)"), id="bfloat16")


def is_bf16(dtype):
    """Whether dtype is bfloat16 (never true without ml_dtypes: ``BF16`` is
    None then, and ``np.dtype("float64") == None`` is True)."""
    return BF16 is not None and np.dtype(dtype) == BF16


DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16_PARAM]
ISAS = [i for i in _core.ISAS if _core.isa_supported(i)]


def logsumexp(z, axis=-1):
    """log sum exp in float64 (numpy only: the core tests need no scipy)."""
    z = np.asarray(z, np.float64)
    m = np.max(z, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(z - m), axis=axis, keepdims=True)) + m, axis=axis)


def log_softmax(z, axis=-1):
    """log softmax in float64 (numpy only)."""
    z = np.asarray(z, np.float64)
    return z - np.expand_dims(logsumexp(z, axis=axis), axis)


def ref_nll(logits, targets, ignore_index=-100):
    """Per-position NLL in float64 from the values the kernel saw."""
    z = np.asarray(logits).astype(np.float64)
    t = np.asarray(targets)
    flat = z.reshape(-1, z.shape[-1])
    tf = t.reshape(-1)
    counted = (tf >= 0) & (tf != ignore_index)
    out = np.zeros(tf.shape, np.float64)
    rows = np.nonzero(counted)[0]
    if rows.size:
        lse = logsumexp(flat[rows], axis=1)
        out[rows] = lse - flat[rows, tf[rows]]
    return out.reshape(t.shape)


# A paired difference of two means (NLL(model) - NLL(reference)) is as
# uncertain as the means it subtracts: its tolerance comes from their
# magnitudes, never from a fraction of the (small) difference itself.
PAIRED_DIFFERENCES = {"loss_diff": ("loss", "loss_ref"), "loss_diff_stderr": ("loss", "loss_ref")}


def assert_metrics_close(got, want, rel, abs=0.0):
    """Compare two ``Metrics.as_dict()`` key by key: each value within
    ``rel`` of its own magnitude (plus ``abs``), a paired difference within
    ``rel`` of its operands' magnitudes."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        if v is None or got[k] is None:
            assert got[k] is v, k
            continue
        scale = sum(math.fabs(want[o]) for o in PAIRED_DIFFERENCES[k]) if k in PAIRED_DIFFERENCES else math.fabs(v)
        assert got[k] == pytest.approx(v, rel=0, abs=rel * scale + abs), k


def random_logits(rng, shape, dtype, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@np.errstate(invalid="ignore")
def ref_entropy(z):
    """-sum p log p per row in float64 (0 log 0 = 0)."""
    lp = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lp)
    return -(np.where(p > 0, p * lp, 0.0)).sum(-1)


def ref_rank(z, t):
    """The rank of target t[i] in row z[i] (z (rows, V), compared in float64
    as given): its place from 0 in the row sorted by decreasing value, ties
    broken by index as argmax breaks them, counted as the values above it
    plus those equal to it at a lower index."""
    zz = np.asarray(z).astype(np.float64)
    tt = np.asarray(t).reshape(-1)
    zt = zz[np.arange(tt.size), tt][:, None]
    before = np.arange(zz.shape[-1])[None, :] < tt[:, None]
    return np.count_nonzero((zz > zt) | ((zz == zt) & before), axis=-1).astype(np.int64)


@np.errstate(invalid="ignore")
def ref_kl(r, z):
    """KL(softmax(r) || softmax(z)) per row in float64."""
    lr = log_softmax(np.asarray(r).astype(np.float64), axis=-1)
    lz = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lr)
    return np.where(p > 0, p * (lr - lz), 0.0).sum(-1)


# The opening of a run_gloo_workers worker whose CPU tensors take the CUDA
# path (its torch path: a batch's pass left to complete at the next read),
# in a gloo group that gives up after 30 seconds: rank, world, dist bound
ROUTED_GLOO_WORKER = """
import datetime, json, os, sys
os.environ["LMMETRICS_TRITON"] = "0"
import torch
import torch.distributed as dist
sys.path[:0] = [sys.argv[4]]
from lmmetrics._engine import inputs

inputs.is_cuda = lambda x: isinstance(x, torch.Tensor)
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=30))
"""


def run_threads(*targets, switch=False, timeout=120):
    """Run each callable on its own thread, started together (a barrier);
    fail naming what any raised, or that one hung. With switch, threads
    switch between any two lines of Python (races show up)."""
    barrier = threading.Barrier(len(targets))
    errors = []

    def run(k, f):
        try:
            barrier.wait()
            f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k, f)) for k, f in enumerate(targets)]
    interval = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(1e-6)
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=timeout)
    finally:
        sys.setswitchinterval(interval)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, "\n".join(errors[:20])


def run_gloo_workers(source, tmp_path, world=2, timeout=120):
    """Run `source` as `world` worker processes (argv: rank, world, a free
    localhost port, this folder) and return each one's last stdout line as
    JSON; a worker that fails fails the test with its stderr."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here] + sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(world), port, here], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:  # a hung or failed worker fails the test and leaves no process behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


class Jobs:
    """A test module's slow jobs (each a callable that runs a subprocess: a
    build, an interpreted kernel group), run in the background two at a
    time, so that the machine's second core works while a test waits for
    its own job. Given each job under its test's name (``item.name``, its
    parameters included); only the jobs of the tests this session selected
    run, in the order those were collected, from the first ``result`` on.
    A job leaves its checks (and skips) to its test, which takes its value
    or exception with ``result``."""

    def __init__(self, request, jobs, workers=2):
        from concurrent.futures import ThreadPoolExecutor

        mod = request.module
        self._order = [item.name for item in request.session.items
                       if getattr(item, "module", None) is mod and item.name in jobs]
        self._jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(workers, os.cpu_count() or 1)))
        self._futures = None

    def result(self, request):
        """The value of the job of the test asking (request: its fixture
        request), raising what the job raised."""
        if self._futures is None:
            self._futures = {name: self._pool.submit(self._jobs[name]) for name in self._order}
        name = request.node.name
        if name not in self._futures:  # (a test not collected with the others: run now)
            self._futures[name] = self._pool.submit(self._jobs[name])
        return self._futures[name].result()

    def close(self):
        """Drops the jobs not started and waits for those running."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def gpu_path_edges(V=700):
    """Rows on which a CUDA path once returned a wrong number, as float64
    numpy (z, r, t) plus what each row must give (the native core gives it
    too): each a (row, key, value) with value None for "as the float64
    reference". V spans several of the Triton tests' 256-element tiles, the
    last one partial."""
    rng = np.random.default_rng(22)
    f32min = float(np.finfo(np.float32).min)
    z = rng.standard_normal((11, V)) * 2
    r = z + rng.standard_normal((11, V)) * 0.3
    t = rng.integers(0, V, 11)
    expect = []
    z[0] = r[0] = -1e30                       # a row masked entirely with a finite value
    expect += [(0, "nll", math.log(V)), (0, "entropy", math.log(V)), (0, "kl", 0.0)]
    z[1] = r[1] = f32min                      # ... with finfo.min
    expect += [(1, "nll", math.log(V)), (1, "entropy", math.log(V))]
    z[2, 5] = 5e9                             # one huge logit takes all the mass
    t[2] = 5
    expect += [(2, "nll", 0.0), (2, "entropy", 0.0), (2, "argmax", 5)]
    z[3, 512:] = r[3, 512:] = f32min          # both mask the last (partial) tiles
    expect += [(3, "kl", None)]
    for row, gap in ((4, 104.0), (5, 300.0), (6, 700.0)):
        z[row, 9] = -math.inf                 # the model rules out what the reference keeps
        r[row, 9] = r[row].max() - gap
        expect += [(row, "kl", math.inf)]
    z[7] += 900.0                             # large offsets on both sides
    r[7] -= 900.0
    expect += [(7, "kl", None), (7, "nll", None)]
    r[8] = z[8] + rng.standard_normal(V) * 1e-4  # nearly the same model: KL tiny, never negative
    expect += [(8, "kl", None)]
    # the model masks with finfo.min where the reference does not, then has
    # logits further on the same lane-rows (a masked prefix; a masked middle
    # from a tile's start): its shift moves by 3.4e38 there, and the KL is
    # that times the reference's mass (the Triton kernel's float sums once
    # clamped the move at 1e30: 3.5e29 for 1.19e38 in row 9 with its
    # default spans, 1.05e38 with the tests' spans of 256)
    z[9, :300] = f32min
    z[10, 256:600] = f32min
    expect += [(9, "kl", None), (10, "kl", None)]
    return z, r, t, expect


def inf_and_nan_head(V, n, bad, nan_row, seed=0):
    """Hidden states h (n, 4) and a head w (V, 4), torch float32, whose
    logits h @ w.T hold +inf (1e30 * 1e30) and NaN (0 * inf) in row bad,
    +inf elsewhere in every other row (0.5 * inf), and NaN across row
    nan_row: lazy logits where +inf hides a NaN from a fast pass's flags."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, 4, generator=g)
    w[5, 0], w[9, 2] = 1e30, math.inf
    h = torch.randn(n, 4, generator=g)
    h[:, 2] = 0.5
    h[bad] = torch.tensor([1e30, 1.0, 0.0, 0.0])  # +inf at 5, NaN at 9
    h[nan_row, 1] = math.nan
    z = h @ w.T
    assert torch.isinf(z[bad]).any() and torch.isnan(z[bad]).any()
    return h, w


def check_gpu_path_edges(device):
    """The rows of gpu_path_edges through the CUDA path for ``device``'s
    tensors (float32; torch, or Triton where the caller routes it): each
    expected value, the float64 reference and the native core on the same
    values; then a float64 reference beside float32 logits, bad reference
    rows and an Evaluator's own state."""
    import torch

    import lmmetrics
    from lmmetrics import _engine

    z, r, t, expect = gpu_path_edges()
    z32, r32 = z.astype(np.float32), r.astype(np.float32)
    kw = dict(nll=True, entropy=True, argmax=True, kl=True, ref_nll=True)
    with np.errstate(all="ignore"):
        got = _engine.run(torch.tensor(z32, device=device), torch.tensor(t, device=device),
                          torch.tensor(r32, device=device), **kw)
    core = _engine.run(z32, t, r32, **kw)
    # the values seen, less each row's max (scipy's logsumexp of a row of
    # -1e30 rounds its log-sum away even in float64)
    zf, rf = (x.astype(np.float64) - x.astype(np.float64).max(1, keepdims=True) for x in (z32, r32))
    refs = {"nll": ref_nll(zf, t), "entropy": ref_entropy(zf), "kl": ref_kl(rf, zf), "ref_nll": ref_nll(rf, t),
            "argmax": np.argmax(zf, 1)}
    for row, key, value in expect:
        want = refs[key][row] if value is None else value
        for name, res in (("cuda path", got), ("native core", core)):
            v = getattr(res, key)[row]
            assert v == pytest.approx(want, rel=2e-6, abs=2e-6), (name, row, key, v, want)
    for key, ref in refs.items():
        np.testing.assert_allclose(getattr(got, key), getattr(core, key), rtol=2e-6, atol=2e-6, err_msg=key)
        if key != "argmax":
            assert (getattr(got, key) >= 0).all(), key
            np.testing.assert_allclose(getattr(got, key), ref, rtol=2e-6, atol=2e-6, err_msg=key)
    # a float64 reference beside float32 logits: the reference's NLL exact in float64
    big, ref64 = z32[8:9] * 50, (z[8:9] * 50 + 1.0)
    got = _engine.run(torch.tensor(big, device=device), torch.tensor(t[8:9], device=device),
                      torch.tensor(ref64, device=device), **kw)
    assert got.ref_nll[0] == pytest.approx(ref_nll(ref64, t[8:9])[0], rel=1e-12, abs=1e-12)
    # bad reference rows raise as on the CPU, a +inf reference logit shares its row's mass
    for bad, value in (("nan", math.nan), ("all -inf", -math.inf), ("+inf", math.inf)):
        rows = [3, 8, 7]
        rb = r32[rows]
        if bad == "all -inf":
            rb[1] = value
        else:
            rb[1, 3] = value
        args = [(torch.tensor(z32[rows], device=device), torch.tensor(t[rows], device=device),
                 torch.tensor(rb, device=device)), (z32[rows], t[rows], rb)]
        outcomes = []
        for zz, tt, rr in args:
            try:
                outcomes.append(lmmetrics.evaluate(zz, tt, reference_logits=rr).kl)
            except ValueError as e:
                outcomes.append(str(e))
        assert isinstance(outcomes[1], str) == (bad != "+inf"), (bad, outcomes)
        assert outcomes[0] == (outcomes[1] if bad != "+inf" else pytest.approx(outcomes[1], rel=2e-6)), \
            (bad, outcomes)
    # an Evaluator takes back its own state (per-token KL never below 0)
    ev = lmmetrics.Evaluator()
    near = z32[8:9] + np.float32(1e-5) * np.ones_like(z32[8:9])
    ev.update(torch.tensor(np.repeat(z32[8:9], 32, 0), device=device), torch.tensor(np.repeat(t[8:9], 32), device=device),
              reference_logits=torch.tensor(np.repeat(near, 32, 0), device=device))
    again = lmmetrics.Evaluator()
    again.load_state_dict(ev.state_dict())
    assert again.compute().kl == ev.compute().kl >= 0


def main_error(capsys, *args):
    """Run the CLI in this process: exit 2 with a one-line error."""
    from lmmetrics.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


class HostReads:
    """Records each read of a tensor by the host while active (``with``): a
    copy to the host (``.cpu()``; whatever way it goes, its values reach
    Python through ``.numpy()`` or ``.tolist()``) and a value that waits for
    the device (``.item()``, ``bool()``, ``int()``, ``float()``,
    ``torch.nonzero``). On a CUDA device each one synchronises; on CPU
    tensors routed through the CUDA path they are counted the same."""

    _METHODS = ("cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        import torch

        self.calls = []
        self.active = False
        for name in self._METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._wrap("nonzero", torch.nonzero))

    def _wrap(self, name, fn):
        def recorded(*a, **kw):
            if self.active:
                self.calls.append(name)
            return fn(*a, **kw)

        return recorded

    def __enter__(self):
        self.calls.clear()
        self.active = True
        return self.calls

    def __exit__(self, *exc):
        self.active = False


# llama.cpp's perplexity tool's KL-divergence statistics, as it prints them
# (tests/api/test_compare.py, tests/cli/test_cli.py)
# llama.cpp's printf formats (tools/perplexity/perplexity.cpp, kl_divergence()),
# copied as written there, for a byte-for-byte check
LLAMA_FORMATS = r"""====== Perplexity statistics ======
Mean PPL(Q)                   : %10.6lf ± %10.6lf
Mean PPL(base)                : %10.6lf ± %10.6lf
Cor(ln(PPL(Q)), ln(PPL(base))): %6.2lf%%
Mean ln(PPL(Q)/PPL(base))     : %10.6lf ± %10.6lf
Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf
Mean PPL(Q)-PPL(base)         : %10.6lf ± %10.6lf

====== KL divergence statistics ======
Mean    KLD: %10.6lf ± %10.6lf
Maximum KLD: %10.6f
99.9%%   KLD: %10.6f
99.0%%   KLD: %10.6f
95.0%%   KLD: %10.6f
90.0%%   KLD: %10.6f
Median  KLD: %10.6f
10.0%%   KLD: %10.6f
 5.0%%   KLD: %10.6f
 1.0%%   KLD: %10.6f
 0.1%%   KLD: %10.6f
Minimum KLD: %10.6f

====== Token probability statistics ======
Mean    Δp: %6.3lf ± %5.3lf %%
Maximum Δp: %6.3lf%%
99.9%%   Δp: %6.3lf%%
99.0%%   Δp: %6.3lf%%
95.0%%   Δp: %6.3lf%%
90.0%%   Δp: %6.3lf%%
75.0%%   Δp: %6.3lf%%
Median  Δp: %6.3lf%%
25.0%%   Δp: %6.3lf%%
10.0%%   Δp: %6.3lf%%
 5.0%%   Δp: %6.3lf%%
 1.0%%   Δp: %6.3lf%%
 0.1%%   Δp: %6.3lf%%
Minimum Δp: %6.3lf%%
RMS Δp    : %6.3lf ± %5.3lf %%
Same top p: %6.3lf ± %5.3lf %%
"""


def llama_text(c):
    """The statistics printed through llama.cpp's own formats."""
    k, dp = c.kld, c.delta_p
    values = [c.ppl.value, c.ppl.uncertainty, c.ppl_ref.value, c.ppl_ref.uncertainty, 100 * c.correlation,
              c.ln_ratio.value, c.ln_ratio.uncertainty, c.ratio.value, c.ratio.uncertainty,
              c.delta_ppl.value, c.delta_ppl.uncertainty, k.mean.value, k.mean.uncertainty, k.max]
    values += [k.percentiles[p] for p in (99.9, 99.0, 95.0, 90.0)] + [k.median]
    values += [k.percentiles[p] for p in (10.0, 5.0, 1.0, 0.1)] + [k.min]
    values += [100 * dp.mean.value, 100 * dp.mean.uncertainty, 100 * dp.max]
    values += [100 * dp.percentiles[p] for p in (99.9, 99.0, 95.0, 90.0, 75.0)] + [100 * dp.median]
    values += [100 * dp.percentiles[p] for p in (25.0, 10.0, 5.0, 1.0, 0.1)] + [100 * dp.min]
    values += [100 * c.rms_delta_p.value, 100 * c.rms_delta_p.uncertainty,
               100 * c.same_top.value, 100 * c.same_top.uncertainty]
    return LLAMA_FORMATS.replace("lf", "f") % tuple(values)


# llama.cpp prints x86-64's default NaN as -nan (other processors: nan)
X86_64 = __import__("platform").machine().lower() in ("x86_64", "amd64")


try:  # lm-evaluation-harness's own rolling window functions
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # a literal copy of lm_eval 0.4.x's algorithm
    def get_rolling_token_windows(token_list, prefix_token, max_seq_len, context_len):
        assert 1 <= context_len <= max_seq_len
        if not token_list:
            return
        pred_len = max_seq_len - context_len + 1
        predicted = 0
        first_seq_len = min(max_seq_len, len(token_list))
        yield [prefix_token] + token_list[: first_seq_len - 1], token_list[:first_seq_len]
        predicted += first_seq_len
        while predicted < len(token_list):
            window_pred_len = min(len(token_list) - predicted, pred_len)
            window_end = predicted + window_pred_len
            yield (token_list[window_end - max_seq_len - 1: window_end - 1],
                   token_list[window_end - window_pred_len: window_end])
            predicted += window_pred_len

    def make_disjoint_window(pair):
        a, b = pair
        return a[: len(a) - (len(b) - 1)], b
