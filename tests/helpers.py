"""What the tests share: the float64 references they compare with, the
dtypes and SIMD paths they run over. A plain module beside the tests
(conftest.py puts this folder on sys.path, so that it imports the same way
under pytest's prepend and importlib modes and in worker subprocesses)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from scipy.special import log_softmax, logsumexp

from lmmetrics import _core

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

# bfloat16 without ml_dtypes: a visible skip, not a case that silently vanishes
BF16_PARAM = BF16 if BF16 is not None else pytest.param(
    None, marks=pytest.mark.skip(reason="bfloat16 needs ml_dtypes (pip install ml_dtypes)"), id="bfloat16")
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16_PARAM]
ISAS = [i for i in _core.ISAS if _core.isa_supported(i)]


def ref_nll(logits, targets, ignore_index=-100):
    """Per-position NLL in float64 from the values the kernel saw (scipy)."""
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


def random_logits(rng, shape, dtype, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@np.errstate(invalid="ignore")
def ref_entropy(z):
    """-sum p log p per row in float64 (0 log 0 = 0)."""
    lp = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lp)
    return -(np.where(p > 0, p * lp, 0.0)).sum(-1)


@np.errstate(invalid="ignore")
def ref_kl(r, z):
    """KL(softmax(r) || softmax(z)) per row in float64."""
    lr = log_softmax(np.asarray(r).astype(np.float64), axis=-1)
    lz = log_softmax(np.asarray(z).astype(np.float64), axis=-1)
    p = np.exp(lr)
    return np.where(p > 0, p * (lr - lz), 0.0).sum(-1)


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
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs
