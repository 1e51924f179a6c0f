"""A process forked after an OpenMP team ran (Python's
multiprocessing with the fork start method, DataLoader workers): the child's
calls must not wait for the parent's threads, which fork did not copy
(libgomp's team then waits for ever). The child runs its jobs on one
thread, with the same bits."""
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core

pytestmark = pytest.mark.skipif(sys.platform == "win32" or "fork" not in mp.get_all_start_methods(),
                                reason="no fork start method here")

RNG = np.random.default_rng(0)
ONE_ROW = RNG.standard_normal((1, 32000)).astype(np.float32)       # a one-row job: two halves, two threads
ROWS = RNG.standard_normal((4, 65536)).astype(np.float32)          # rows over threads
T1, T4 = np.array([5]), np.array([1, 2, 3, 4])


def _child_work(_):
    return (lmmetrics.cross_entropy(ONE_ROW, T1, reduction="sum"),
            lmmetrics.token_nll(ROWS, T4).tolist(),
            lmmetrics.evaluate(ROWS, T4, reference_logits=ROWS[::-1].copy()).loss,
            _core.read_pass(ROWS.ctypes.data, ROWS.nbytes, 2))


@pytest.mark.skipif(not _core.openmp(), reason="built without OpenMP")
# Python 3.12+ warns of any fork while threads run (the OpenMP team's idle
# workers here): that fork is the case under test
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_child_forked_after_a_team_does_not_wait_for_it():
    # the parent runs teams of two threads first (two halves of one row; rows)
    want = (lmmetrics.cross_entropy(ONE_ROW, T1, reduction="sum", num_threads=2),
            lmmetrics.token_nll(ROWS, T4, num_threads=2).tolist(),
            lmmetrics.evaluate(ROWS, T4, reference_logits=ROWS[::-1].copy(), num_threads=2).loss,
            _core.read_pass(ROWS.ctypes.data, ROWS.nbytes, 2))
    with mp.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_child_work, range(2)).get(timeout=60)   # (a hang: TimeoutError)
    # the same bits on one thread as on two
    assert got == [want, want]


_TORCH_TEAM_FIRST = """
import multiprocessing as mp, numpy as np, torch
torch.set_num_threads(2)
torch.ones(1 << 22).exp().sum()          # torch's OpenMP team (its libgomp.so.1 serves lmmetrics too)
import lmmetrics
z = np.random.default_rng(0).standard_normal((4, 65536)).astype(np.float32)
t = np.arange(4)
def work(_):
    return lmmetrics.token_nll(z, t, num_threads=2).tolist()
if __name__ == "__main__":
    want = lmmetrics.token_nll(z, t, num_threads=1).tolist()
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.map_async(work, [0]).get(timeout=60) == [want]
    print("ok")
"""


@pytest.mark.skipif(not _core.openmp(), reason="built without OpenMP")
def test_a_child_forked_after_another_librarys_team_does_not_wait_for_it(tmp_path):
    # the parent's team is torch's, on the same OpenMP runtime, and
    # lmmetrics never ran one before the fork
    pytest.importorskip("torch")
    script = tmp_path / "torch_team_first.py"
    script.write_text(_TORCH_TEAM_FIRST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


_EVALUATOR = lmmetrics.Evaluator()


def _child_compute(queue):
    queue.put(_EVALUATOR.compute().tokens)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_child_forked_while_another_thread_updates_an_evaluator_does_not_wait_for_it():
    # another thread holds the Evaluator's lock when the process forks (an
    # update on its way): that thread is not in the child, whose calls
    # waited for it for ever; the child has the batches added before
    import threading

    _EVALUATOR.reset()
    _EVALUATOR.update(ROWS, T4)
    held, done = threading.Event(), threading.Event()

    def updating():
        with _EVALUATOR._lock:
            held.set()
            done.wait(60)

    thread = threading.Thread(target=updating)
    thread.start()
    try:
        assert held.wait(60)
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_compute, args=(queue,))
        child.start()
        try:
            assert queue.get(timeout=60) == 4
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
    finally:
        done.set()
        thread.join()
    assert _EVALUATOR.compute().tokens == 4
