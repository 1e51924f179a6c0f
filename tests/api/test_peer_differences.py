"""Where lmmetrics differs from a peer on purpose, as the docs say
(docs/guarantees.md, docs/guides/basics.md): each difference measured on
the peer's own code, and ours against an independent float64 reference."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

import lmmetrics
from helpers import log_softmax

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")
from torchmetrics.functional.classification import multiclass_calibration_error  # noqa: E402
from torchmetrics.text import Perplexity as TMPerplexity  # noqa: E402


def test_ignore_index_none_never_scores_a_negative_target():
    """torchmetrics' Perplexity(ignore_index=None) scores a target of -1 as
    vocabulary entry V-1; we never count a negative target."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 40, 11)).astype(np.float32) * 3
    t = rng.integers(0, 11, (1, 40))
    t[0, ::3] = -1
    lp = log_softmax(z[0])
    counted = t[0] >= 0
    ours_want = math.exp(-lp[np.arange(40), t[0]][counted].mean())
    as_last = np.where(counted, t[0], 10)  # torch's negative indexing: -1 is V-1
    theirs_want = math.exp(-lp[np.arange(40), as_last].mean())
    theirs = TMPerplexity(ignore_index=None)(torch.from_numpy(z), torch.from_numpy(t)).item()
    assert theirs == pytest.approx(theirs_want, rel=1e-5)
    ours = lmmetrics.perplexity(z, t, ignore_index=None)
    assert ours == pytest.approx(ours_want, rel=1e-6)
    assert abs(ours - theirs) > 1e-3 * ours  # the difference the docs describe


def test_a_confidence_of_one_falls_in_the_last_bin():
    """torchmetrics gives a confidence of exactly 1.0 a bin of its own; we
    close the last bin (the usual definition)."""
    z = np.array([[0.0, -800.0], [0.0, math.log(0.4 / 0.6)]])  # top probabilities 1.0 and 0.6
    t = np.array([1, 0])  # the certain one wrong, the other right
    p = np.exp(log_softmax(z))
    assert p[0, 0] == 1.0
    conf, correct = p.max(1), (p.argmax(1) == t).astype(float)
    # two equal-width bins, the last closed: both tokens in [0.5, 1]
    want = abs(correct.mean() - conf.mean())
    assert lmmetrics.expected_calibration_error(z, t, bins=2) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(0.3)
    theirs = multiclass_calibration_error(torch.from_numpy(p), torch.from_numpy(t), num_classes=2, n_bins=2,
                                          norm="l1").item()
    assert theirs == pytest.approx(0.5 * abs(0 - 1.0) + 0.5 * abs(1 - 0.6), rel=1e-6)  # 1.0 on its own
