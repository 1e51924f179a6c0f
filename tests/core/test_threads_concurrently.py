"""Python threads calling the library at the same time (the GIL is released
in the native core, each call runs its own OpenMP team): every result is
bitwise identical to the one computed serially beforehand.

8 threads x 10 rounds; each round a thread runs every job in the list (in
its own rotated order), with its own num_threads, on inputs shared by all
threads and on inputs of its own.
"""
import copy
import functools
import math
import pickle
import threading
import time

import numpy as np
import pytest

import lmmetrics
from helpers import BF16, run_threads

torch = pytest.importorskip("torch")

N_THREADS = 8
ROUNDS = 10


def _bits(x):
    """A hashable exact image of a result."""
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, float):
        return ("f", np.float64(x).tobytes())
    if hasattr(x, "as_dict"):
        return tuple((k, _bits(v) if isinstance(v, float) else v) for k, v in x.as_dict().items())
    raise TypeError(type(x))


def _inputs(seed):
    rng = np.random.default_rng(seed)
    out = {}
    z = (rng.standard_normal((4, 33, 4099)) * 3).astype(np.float32)
    r = (z + rng.standard_normal(z.shape).astype(np.float32) * 0.3).astype(np.float32)
    t = rng.integers(0, 4099, (4, 33))
    t[:, ::5] = -100
    out["f32"] = (z[:, :-1], r[:, :-1], t[:, 1:])      # shifted views
    zb = (rng.standard_normal((40, 32001)) * 4).astype(BF16 or np.float32)
    rb = (zb.astype(np.float32) + 0.5).astype(zb.dtype)
    out["bf16"] = (zb, rb, rng.integers(0, 32001, 40))
    zd = rng.standard_normal((3, 17, 2050))
    zd[:, :, ::7] = -np.inf
    td = rng.integers(0, 2050, (3, 17))
    td[0, :] = -1
    out["f64"] = (zd, zd[::-1].copy(), td)
    zt = torch.from_numpy((rng.standard_normal((16, 8000)) * 2).astype(np.float32)).to(torch.bfloat16)
    out["torch"] = (zt, (zt.float() * 0.9).to(torch.bfloat16), torch.from_numpy(rng.integers(0, 8000, 16)))
    return out


def _jobs(inputs):
    jobs = []
    for name, (z, r, t) in inputs.items():
        jobs.append((f"ce-sum-{name}", lambda nt, z=z, t=t: lmmetrics.cross_entropy(
            z, t, reduction="sum", num_threads=nt)))
        jobs.append((f"nll-{name}", lambda nt, z=z, t=t: lmmetrics.token_nll(z, t, softcap=30.0, num_threads=nt)))
        jobs.append((f"eval-{name}", lambda nt, z=z, r=r, t=t: lmmetrics.evaluate(
            z, t, reference_logits=r, num_threads=nt)))
        jobs.append((f"kl-{name}", lambda nt, z=z, r=r: lmmetrics.token_kl(z, reference_logits=r, num_threads=nt)))
    return jobs


def test_threads_calling_at_once_match_serial():
    shared = _inputs(0)
    own = [_inputs(100 + k) for k in range(N_THREADS)]
    shared_jobs = _jobs(shared)
    own_jobs = [_jobs(o) for o in own]
    # serial results, one OpenMP thread
    want_shared = {name: _bits(f(1)) for name, f in shared_jobs}
    want_own = [{name: _bits(f(1)) for name, f in jobs} for jobs in own_jobs]
    # sanity: the serial results are numbers, not NaN
    assert all(not math.isnan(f(1)) for name, f in shared_jobs if name.startswith("ce-"))

    mismatches = []
    done = [0] * N_THREADS

    def worker(k):
        jobs = [(j, True) for j in shared_jobs] + [(j, False) for j in own_jobs[k]]
        for rnd in range(ROUNDS):
            nt = 1 + (k + rnd) % 4  # 1..4 OpenMP threads, changing per round
            rot = (k * 3 + rnd) % len(jobs)
            for (name, f), is_shared in jobs[rot:] + jobs[:rot]:
                got = _bits(f(nt))
                want = (want_shared if is_shared else want_own[k])[name]
                if got != want:
                    mismatches.append(f"thread {k} round {rnd} {name} num_threads={nt}: differs from serial")
                done[k] += 1

    run_threads(*[functools.partial(worker, k) for k in range(N_THREADS)])
    assert not mismatches, "\n".join(mismatches[:20])
    assert done == [ROUNDS * (len(shared_jobs) + len(own_jobs[k])) for k in range(N_THREADS)]


def test_one_evaluator_updated_from_many_threads_adds_every_batch():
    # updates of one Evaluator from several threads at once are added one
    # at a time: every batch counted, the sums those of a serial run (up to
    # the order of the additions)
    rng = np.random.default_rng(7)
    batches = [((rng.standard_normal((3, 9)) * 2).astype(np.float32), rng.integers(0, 9, 3), k % 50)
               for k in range(1600)]
    kw = dict(top_k=(1, 3), calibration_bins=10)
    serial = lmmetrics.Evaluator(**kw)
    for z, t, d in batches:
        serial.update(z, t, document_ids=d, reference_logits=z[::-1].copy())
    want = serial.compute()
    shared = lmmetrics.Evaluator(**kw)

    def worker(k):
        for z, t, d in batches[k::N_THREADS]:
            shared.update(z, t, document_ids=d, reference_logits=z[::-1].copy())
            if d == 0:
                shared.compute()   # reads in between see whole batches

    run_threads(*[functools.partial(worker, k) for k in range(N_THREADS)])
    got = shared.compute()
    assert got.tokens == want.tokens == 4800
    for k, v in want.as_dict().items():
        if isinstance(v, float):
            assert got.as_dict()[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
        elif not isinstance(v, (dict, list)):
            assert got.as_dict()[k] == v, k


def test_the_methods_that_hold_the_lock_keep_their_annotations():
    # the methods run while holding the Evaluator's lock are the methods as
    # written for inspection: their annotations and module (get_type_hints
    # gave the wrapper's: self an Evaluator, Any elsewhere, on the
    # torchmetrics metrics' methods too)
    import typing

    assert typing.get_type_hints(lmmetrics.Evaluator.compute) == {"return": lmmetrics.Metrics}
    assert typing.get_type_hints(lmmetrics.Evaluator.all_reduce) == {"group": typing.Any,
                                                                     "return": lmmetrics.Evaluator}
    tm = pytest.importorskip("lmmetrics.torchmetrics")
    assert tm.Perplexity.reset.__module__ == "lmmetrics.torchmetrics"
    assert typing.get_type_hints(tm.Perplexity.reset) == {"return": type(None)}


def test_merges_while_the_merged_evaluator_is_updated_count_every_batch_once():
    # a.merge(b) while another thread updates b (and b.merge(a) the other
    # way at once): both Evaluators' locks are held, in one order whichever
    # merges which, so a batch is added once and two opposite merges never
    # wait on each other
    rng = np.random.default_rng(11)
    batches = [((rng.standard_normal((2, 7)) * 2).astype(np.float32), rng.integers(0, 7, 2)) for _ in range(600)]
    kw = dict(calibration_bins=10)
    a, b, c = lmmetrics.Evaluator(**kw), lmmetrics.Evaluator(**kw), lmmetrics.Evaluator(**kw)

    def update_b():
        for z, t in batches:
            b.update(z, t)

    def merge_into_a():  # a copy of b's sums at each moment, added to an empty a each time
        for _ in range(200):
            a.reset()
            a.merge(b)
            m = a.compute()   # the sums and the bins of one moment of b's
            assert m.tokens % 2 == 0 and m.tokens <= 1200 and m.calibration.total == m.tokens

    def merge_into_c():  # the other way round at once: b's lock first here, c's there
        for _ in range(200):
            c.reset()
            c.merge(b)
            b_snapshot = lmmetrics.Evaluator(**kw).merge(c)
            assert b_snapshot.compute().tokens == c.compute().tokens

    # (threads switch between any two lines: a merge reads mid-update)
    run_threads(update_b, merge_into_a, merge_into_c, switch=True)
    a.reset()
    a.merge(b)
    want = lmmetrics.Evaluator(**kw)
    for z, t in batches:
        want.update(z, t)
    assert a.compute().tokens == b.compute().tokens == 1200
    assert a.compute().loss == pytest.approx(want.compute().loss, rel=1e-12)


def test_copies_while_an_update_waits_on_a_device_add_its_batch_once(monkeypatch):
    # an Evaluator of CUDA tensors (here CPU tensors routed through that
    # path) keeps one batch not yet added; a deepcopy or a pickle adds it
    # first, and one taken while another thread was adding it added it a
    # second time (both saw it waiting; adding it is slowed down here)
    from lmmetrics._engine import inputs as _inputs

    monkeypatch.setattr(_inputs, "is_cuda", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setenv("LMMETRICS_TRITON", "0")
    take = lmmetrics.Evaluator._take
    monkeypatch.setattr(lmmetrics.Evaluator, "_take", lambda *a: time.sleep(0.002) or take(*a))
    rng = np.random.default_rng(5)
    batches = [(torch.from_numpy(rng.standard_normal((3, 9)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 9, 3))) for _ in range(60)]
    ev = lmmetrics.Evaluator()
    done = threading.Event()
    seen = []

    def update():
        try:
            for z, t in batches:
                ev.update(z, t)
        finally:
            done.set()

    def copy_it():
        while not done.is_set():
            seen.append(copy.deepcopy(ev).compute().tokens)
            seen.append(pickle.loads(pickle.dumps(ev)).compute().tokens)

    run_threads(update, copy_it, copy_it)
    assert ev.compute().tokens == 180
    assert seen and all(n % 3 == 0 and n <= 180 for n in seen)
