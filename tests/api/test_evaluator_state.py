"""Evaluator.load_state_dict takes back exactly what state_dict gave and
refuses any state that no Evaluator with its settings holds; calibration bins
are bounded wherever they are accepted."""
import copy
import json
import math

import numpy as np
import pytest

import lmmetrics
from helpers import main_error
from lmmetrics.ranking import MAX_BINS

V = 60
SETTINGS = dict(top_k=(1, 3), calibration_bins=5)


def _batches(seed=0, inf=True):
    rng = np.random.default_rng(seed)
    tb = rng.integers(0, 4, V)
    out = []
    for b in range(2):
        z = (rng.standard_normal((3, 7, V)) * 2).astype(np.float32)
        r = (z + rng.standard_normal(z.shape) * 0.4).astype(np.float32)
        t = rng.integers(0, V, (3, 7))
        t[0, :2] = -100
        doc = np.repeat(np.arange(3) + 2 * b, 7).reshape(3, 7)  # document 2 spans both batches
        out.append((z, r, t, doc))
    if inf:  # a target the model rules out (document 1): an inf NLL in the sums
        z = out[0][0]
        z[1, 3, :] = 0.0
        z[1, 3, out[0][2][1, 3]] = -np.inf
    return tb, out


def _evaluator(docs=True, ref=True, inf=True, **kw):
    tb, batches = _batches(inf=inf)
    ev = lmmetrics.Evaluator(**dict(dict(token_bytes=tb, **SETTINGS), **kw))
    for z, r, t, doc in batches:
        ev.update(z, t, reference_logits=r if ref else None, document_ids=doc if docs else None)
    return ev


def _same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("kw", [dict(), dict(docs=False), dict(ref=False), dict(nll_only=True),
                                dict(token_bytes=None, top_k=None, calibration_bins=None)])
def test_a_state_dict_round_trips_exactly(kw):
    ev = _evaluator(**kw)
    state = ev.state_dict()
    assert math.isinf(state["nll_sum"])  # the ruled-out target
    again = _evaluator(**kw)
    again.reset()
    again.load_state_dict(json.loads(json.dumps(state)))  # through JSON, as a checkpoint goes
    assert again.state_dict() == state
    want, got = ev.compute().as_dict(), again.compute().as_dict()
    assert want.keys() == got.keys() and all(_same(want[k], got[k]) for k in want), (want, got)


def _tamper(state, path, value):
    """A copy of state with state[path[0]][path[1]]... replaced by value
    (a callable gets the old value)."""
    bad = copy.deepcopy(state)
    d = bad
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return bad


def _plus(i, dx):
    def f(v):
        v = list(v)
        v[i] += dx
        return v
    return f


BAD = {
    # documents: ids, lengths, counts, totals
    "a fractional id": (("documents", "ids"), _plus(0, 0.5), "ids must be a list of integers"),
    "whole float ids": (("documents", "ids"), lambda v: [float(x) for x in v], "ids must be a list of integers"),
    "bool ids": (("documents", "ids"), lambda v: [True] * len(v), "ids must be a list of integers"),
    "nested ids": (("documents", "ids"), lambda v: [v], "ids must be a list of integers"),
    "an id past int64": (("documents", "ids"), _plus(0, 2**64), "ids must"),
    "a repeated id": (("documents", "ids"), lambda v: [v[0]] + v[:-1], "one row of sums per distinct id"),
    "an id too few": (("documents", "ids"), lambda v: v[:-1], "documents hold 4 ids and tokens shaped"),
    "a column too short": (("documents", "kl_sum"), lambda v: v[:-1], "kl_sum shaped"),
    "a fractional token count": (("documents", "tokens"), _plus(0, 0.5), "whole numbers"),
    "a fractional byte count": (("documents", "bytes"), _plus(1, 0.25), "whole numbers"),
    "document tokens above the total": (("documents", "tokens"), _plus(0, 1), "documents' tokens add up to"),
    "document tokens moved": (("documents", "tokens"), lambda v: [v[0] + 1, v[1] - 1] + v[2:],
                              "each document holds a counted token, and no more correct"),
    "document bytes off": (("documents", "bytes"), _plus(2, 3), "documents' bytes add up to"),
    "document NLL off": (("documents", "nll_sum"), _plus(0, 0.5), "documents' nll_sum add up to"),
    "document entropy off": (("documents", "entropy_sum"), _plus(1, 1e-3), "documents' entropy_sum"),
    "a negative document sum": (("documents", "kl_sum"), _plus(0, -1e9), "non-negative"),
    "a document with more correct than tokens": (("documents", "correct"), lambda v: [99.0] + v[1:],
                                                 "no more correct"),
    "a document without tokens": (("documents",), lambda d: {k: v + [0.0 if k != "ids" else 99]
                                                             for k, v in d.items()}, "holds a counted token"),
    "more same_top than kl_tokens": (("same_top",), lambda v: 10**4, "same_top .* exceeds kl_tokens"),
    # ranks and bins against the totals
    "rank hits shrinking with k": (("rank", "hits"), lambda v: [v[1], v[0]], "grow with k"),
    "reciprocal ranks above the tokens": (("rank", "rr_sum"), lambda v: 1e6, "reciprocal ranks"),
    "a bin more": (("calibration", "counts"), _plus(0, 1), "calibration bins hold"),
    "fractional bin counts, the total kept": (("calibration", "counts"), lambda v: [v[0] - 0.4, v[1] + 0.4] + v[2:],
                                              "whole numbers"),
    "confidence outside its bin": (("calibration", "conf_sum"), lambda v: [c + 1.0 for c in v],
                                   "outside its edges"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_load_state_dict_refuses_a_state_no_state_dict_gives(what):
    path, value, message = BAD[what]
    ev = _evaluator(inf=False)  # finite totals: a document's NLL moved shows
    state = ev.state_dict()
    bad = _tamper(state, path, value)
    assert repr(bad) != repr(state)
    with pytest.raises(ValueError, match="Evaluator state: " + ".*" + message):
        ev.load_state_dict(bad)
    assert ev.state_dict() == state  # nothing changed


@pytest.mark.parametrize("part,whole", [("nll_sum_bytes", "nll_sum"), ("nll_sq_bytes", "nll_sq"),
                                        ("nll_sum_paired", "nll_sum"), ("kl_tokens", "tokens")])
def test_load_state_dict_refuses_a_part_above_its_whole(part, whole):
    ev = _evaluator(docs=False, inf=False)
    state = ev.state_dict()
    assert state[part] <= state[whole] and math.isfinite(state[whole])
    bad = dict(state, **{part: state[whole] + 1 if part == "kl_tokens" else state[whole] * 1.01 + 1})
    with pytest.raises(ValueError, match=f"{part} .* exceeds {whole}"):
        ev.load_state_dict(bad)
    assert ev.state_dict() == state


def test_counts_are_compared_exactly_however_large():
    """A count one above its whole is refused even where the float sums'
    relative slack (1e-6) would hide it: 2,000,001 correct of 2,000,000
    tokens is an accuracy above 1."""
    ev = _evaluator(docs=False, inf=False, top_k=None, calibration_bins=None)
    state = ev.state_dict()
    big = dict(state, tokens=2_000_000, correct=2_000_001, kl_tokens=2_000_000, same_top=0)
    with pytest.raises(ValueError, match="correct .* exceeds tokens"):
        ev.load_state_dict(big)
    assert ev.state_dict() == state


def test_a_state_dict_records_its_settings_and_is_refused_by_an_evaluator_with_others():
    """A state is refused by an Evaluator made with other settings, naming
    them, and that Evaluator is left as it was: an nll_only state in a full
    Evaluator read accuracy 0 and entropy 0, a state without token_bytes in
    one with them bits per byte inf, another softcap or ignore_index loaded
    silently."""
    tb = _batches()[0]
    plain = dict(docs=False, top_k=None, calibration_bins=None)
    loader = dict(token_bytes=tb)
    cases = [(dict(nll_only=True), "nll_only"), (dict(token_bytes=None), "token_bytes"),
             (dict(token_bytes=tb[::-1].copy()), "token_bytes"), (dict(softcap=30.0), "softcap"),
             (dict(ignore_index=-1), "ignore_index"), (dict(top_k=(1, 3)), "top_k"),
             (dict(calibration_bins=5), "calibration_bins")]
    for made, name in cases:
        state = json.loads(json.dumps(_evaluator(**dict(plain, **made)).state_dict()))
        assert set(state["settings"]) == {"ignore_index", "softcap", "nll_only", "top_k", "calibration_bins",
                                          "token_bytes"}
        ev = lmmetrics.Evaluator(**loader)
        ev.update(np.zeros((2, V), np.float32), np.array([1, 2]))
        before = ev.state_dict()
        with pytest.raises(ValueError, match=f"made with another {name} than this Evaluator's"):
            ev.load_state_dict(state)
        assert ev.state_dict() == before
        lmmetrics.Evaluator(**dict(loader, **made)).load_state_dict(state)  # (its own settings take it)
    with pytest.raises(ValueError, match="settings must hold"):
        lmmetrics.Evaluator().load_state_dict(dict(lmmetrics.Evaluator().state_dict(), settings={"softcap": 0}))


def test_load_state_dict_refuses_the_state_of_an_evaluator_with_other_settings():
    """A state without its settings (an older version's state_dict) is
    refused where its values show that no Evaluator with these settings
    gives it."""
    full = _evaluator(docs=False, top_k=None, calibration_bins=None).state_dict()
    full.pop("settings")
    with pytest.raises(ValueError, match="bytes is .* but this Evaluator has no token_bytes"):
        lmmetrics.Evaluator().load_state_dict(full)
    with pytest.raises(ValueError, match="correct is .* but this Evaluator is nll_only"):
        lmmetrics.Evaluator(token_bytes=np.ones(V, int), nll_only=True).load_state_dict(full)
    with pytest.raises(ValueError, match="missing \\['rank'\\]"):
        lmmetrics.Evaluator(token_bytes=np.ones(V, int), top_k=2).load_state_dict(full)
    ranked = _evaluator(docs=False).state_dict()
    ranked.pop("settings")
    with pytest.raises(ValueError, match="rank must hold k \\[1, 2\\]"):
        lmmetrics.Evaluator(token_bytes=np.ones(V, int), top_k=(1, 2), calibration_bins=5).load_state_dict(ranked)
    with pytest.raises(ValueError, match="calibration must hold 6"):
        lmmetrics.Evaluator(token_bytes=np.ones(V, int), top_k=(1, 3), calibration_bins=6).load_state_dict(ranked)


@pytest.mark.parametrize("key,value,message", [
    ("nll_sum", 1.0, "nll_sum is 1.0 but no token is counted"),
    ("kl_sum", 0.5, "kl_sum is 0.5 but no token is counted"),
    ("bytes", 3, "bytes is 3 but no token is counted"),
])
def test_load_state_dict_refuses_sums_without_tokens(key, value, message):
    ev = lmmetrics.Evaluator(token_bytes=np.ones(4, int))
    ev.update(np.zeros((2, 4), np.float32), np.array([-100, -100]))  # ignored positions only
    state = ev.state_dict()
    assert state["ignored"] == 2 and state["tokens"] == 0
    with pytest.raises(ValueError, match=message):
        ev.load_state_dict(dict(state, **{key: value}))


def test_load_state_dict_refuses_reference_sums_without_reference_tokens():
    ev = _evaluator(docs=False, ref=False, top_k=None, calibration_bins=None)
    state = ev.state_dict()
    assert state["kl_tokens"] == 0
    for key in ("kl_sum", "same_top", "ref_nll_sum", "diff_sq"):
        with pytest.raises(ValueError, match=f"{key} is .* but kl_tokens is 0"):
            ev.load_state_dict(dict(state, **{key: 1}))


# -- calibration bins: bounded before anything is sized by them ---------------

def test_calibration_bins_are_bounded_everywhere():
    z = np.log(np.array([[0.9, 0.1], [0.6, 0.4]], np.float32))
    t = np.array([0, 1])
    assert MAX_BINS == 100_000
    too_many = MAX_BINS + 1
    calls = {
        "evaluate": lambda b: lmmetrics.evaluate(z, t, calibration_bins=b),
        "Evaluator": lambda b: lmmetrics.Evaluator(calibration_bins=b),
        "calibration": lambda b: lmmetrics.calibration(z, t, bins=b),
        "expected_calibration_error": lambda b: lmmetrics.expected_calibration_error(z, t, bins=b),
        "Calibration.from_arrays": lambda b: lmmetrics.Calibration.from_arrays([0.5], [True], bins=b),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="bins must be at most 100,000"):
            call(too_many)
        with pytest.raises(ValueError, match="bins must be"):
            call(10**12)
        call(MAX_BINS)  # the bound itself is fine
    with pytest.raises(ValueError, match="calibration_bins must be at most"):
        lmmetrics.Evaluator(calibration_bins=np.int64(10**8))
    assert lmmetrics.evaluate(z, t, calibration_bins=MAX_BINS).calibration.bins == MAX_BINS


def test_cli_bins_are_bounded(tmp_path, capsys):
    np.save(tmp_path / "z.npy", np.zeros((2, 5, 4), np.float32))
    np.save(tmp_path / "t.npy", np.zeros((2, 5), np.int64))
    err = main_error(capsys, "score", tmp_path / "z.npy", tmp_path / "t.npy", "--plot", tmp_path / "x.png",
                     "--bins", str(MAX_BINS + 1))
    assert "--bins" in err and "at most 100,000" in err
