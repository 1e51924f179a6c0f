"""Evaluator.all_reduce and evaluate_bpb across two real torch.distributed
processes (gloo over loopback), and evaluate_bpb against nanochat's
algorithm with a tiny torch model."""
import math
import textwrap

import numpy as np
import pytest

import lmmetrics
from helpers import ROUTED_GLOO_WORKER, run_gloo_workers

torch = pytest.importorskip("torch")
F = torch.nn.functional


class TinyLM(torch.nn.Module):
    def __init__(self, V=97, d=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, d)
        self.out = torch.nn.Linear(d, V)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x))) * 3


def batches(V=97, B=3, T=20, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T), generator=g)
        y = torch.randint(0, V, (B, T), generator=g)
        y[0, :4] = -1  # nanochat marks ignored targets with -1
        out.append((x, y))
    return out


def token_bytes_table(V=97):
    tb = torch.randint(1, 5, (V,), generator=torch.Generator().manual_seed(2))
    tb[:4] = 0  # special tokens
    return tb


def nanochat_bpb(model, data, steps, token_bytes, softcap=None, cap_dtype=torch.float32):
    """nanochat's loss_eval.evaluate_bpb, written from its algorithm; with
    softcap, GPT.forward's cap on the head's logits first, in float32 as
    nanochat applies it (``logits.float()``, then ``softcap * tanh(logits /
    softcap)``), or in cap_dtype."""
    total_nats, total_bytes = 0.0, 0
    with torch.no_grad():
        for x, y in data[:steps]:
            logits = model(x)
            if softcap is not None:
                logits = logits.to(cap_dtype)
                logits = softcap * torch.tanh(logits / softcap)
            logits = logits.double()
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1,
                                   reduction="none")
            yv = y.view(-1)
            valid = yv >= 0
            nb = torch.where(valid, token_bytes[torch.where(valid, yv, 0)], 0)
            total_nats += (loss * (nb > 0)).sum().item()
            total_bytes += int(nb.sum())
    return math.inf if total_bytes == 0 else total_nats / (math.log(2) * total_bytes)


def test_evaluate_bpb_matches_nanochat():
    model, data, tb = TinyLM(), batches(), token_bytes_table()
    got = lmmetrics.evaluate_bpb(model, iter(data), 3, tb)
    assert got == pytest.approx(nanochat_bpb(model, data, 3, tb), rel=1e-6)
    assert got != pytest.approx(nanochat_bpb(model, data, 4, tb), rel=1e-6)  # reads exactly `steps`


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_evaluate_bpb_softcap_as_nanochat_applies_it(dtype):
    """A model returning the head's raw logits (large: the cap matters), capped as nanochat's
    GPT.forward caps them, against torch's float32 cap and float64 cross-entropy."""
    tiny = TinyLM()
    model = lambda x: (tiny(x) * 8).to(dtype)  # noqa: E731
    data, tb = batches(), token_bytes_table()
    assert model(data[0][0]).abs().max() > 30  # well into tanh's bend at softcap 15
    got = lmmetrics.evaluate_bpb(model, iter(data), 3, tb, softcap=15.0)
    assert got == pytest.approx(nanochat_bpb(model, data, 3, tb, softcap=15.0), rel=1e-6)
    # the cap in float64 agrees as closely: float32's rounding of the cap moves the sixth digit no more
    assert got == pytest.approx(nanochat_bpb(model, data, 3, tb, softcap=15.0, cap_dtype=torch.float64), rel=1e-6)
    assert got != pytest.approx(lmmetrics.evaluate_bpb(model, iter(data), 3, tb), rel=1e-2)  # the cap applied
    with pytest.raises(ValueError, match="softcap"):
        lmmetrics.evaluate_bpb(model, iter(data), 1, tb, softcap=0.0)


@pytest.mark.parametrize("steps", [0, -1, True, 1.0, "2"])
def test_evaluate_bpb_refuses_a_step_count_that_is_not_a_positive_integer(steps):
    model, data = TinyLM(), batches(n=2)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        lmmetrics.evaluate_bpb(model, iter(data), steps, torch.ones(97, dtype=torch.int64))


def test_evaluate_bpb_takes_a_step_count_in_a_tensor():
    model, data = TinyLM(), batches(n=2)
    tb = torch.ones(97, dtype=torch.int64)
    assert lmmetrics.evaluate_bpb(model, iter(data), torch.tensor(2), tb) == \
        lmmetrics.evaluate_bpb(model, iter(data), 2, tb)


def test_evaluate_bpb_says_when_the_batches_run_out():
    """Fewer batches than steps: a ValueError naming both, not a bare
    StopIteration (which a caller's generator turns into its own end, or a
    RuntimeError)."""
    model, data = TinyLM(), batches(n=2)
    with pytest.raises(ValueError, match="batches ran out after 2 of steps=3"):
        lmmetrics.evaluate_bpb(model, iter(data), 3, torch.ones(97, dtype=torch.int64))


def test_evaluate_bpb_no_bytes_is_inf():
    model, data = TinyLM(), batches(n=1)
    assert lmmetrics.evaluate_bpb(model, data, 1, torch.zeros(97, dtype=torch.int64)) == math.inf


def test_evaluate_bpb_accepts_an_output_with_logits():
    class Out:
        def __init__(self, logits):
            self.logits = logits

    model, data, tb = TinyLM(), batches(), token_bytes_table()
    wrapped = lambda x: Out(model(x))  # noqa: E731
    assert lmmetrics.evaluate_bpb(wrapped, data, 2, tb) == pytest.approx(nanochat_bpb(model, data, 2, tb), rel=1e-6)


WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    import lmmetrics
    from test_distributed import TinyLM, batches, token_bytes_table

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((40, 500)).astype(np.float32) * 2
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    t = rng.integers(-1, 500, 40)
    tb = rng.integers(0, 4, 500)
    ev = lmmetrics.Evaluator(token_bytes=tb, ignore_index=-1)
    part = slice(rank * 25, 25 + rank * 15)  # unequal shards: 25 and 15 rows
    doc = np.arange(40) // 7  # document 3 spans both shards
    ev.update(z[part], t[part], reference_logits=r[part], document_ids=doc[part])
    metrics = ev.all_reduce().compute().as_dict()
    model, data = TinyLM(), batches(n=4)
    bpb = lmmetrics.evaluate_bpb(model, data[rank * 2:rank * 2 + 2], 2, token_bytes_table())
    print(json.dumps({"metrics": metrics, "bpb": bpb}))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_all_reduce_across_two_gloo_processes(tmp_path):
    outs = run_gloo_workers(WORKER, tmp_path)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((40, 500)).astype(np.float32) * 2
    r = (z + rng.standard_normal(z.shape) * 0.3).astype(np.float32)
    t = rng.integers(-1, 500, 40)
    tb = rng.integers(0, 4, 500)
    whole = lmmetrics.evaluate(z, t, token_bytes=tb, reference_logits=r, ignore_index=-1,
                               document_ids=np.arange(40) // 7).as_dict()
    assert whole["documents"] == 6 and "macro_loss_stderr" in whole and "loss_stderr_documents" in whole
    for o in outs:  # every rank holds the global numbers, documents split across ranks joined
        assert o["metrics"].keys() == whole.keys()
        for k, v in whole.items():
            assert o["metrics"][k] == pytest.approx(v, rel=1e-12), k
    expected_bpb = nanochat_bpb(TinyLM(), batches(n=4), 4, token_bytes_table())
    assert outs[0]["bpb"] == outs[1]["bpb"] == pytest.approx(expected_bpb, rel=1e-6)


# -- ranks that cannot be summed: every rank raises the same error, none hangs ---------------------

MISMATCH_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import numpy as np
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    import lmmetrics
    from test_distributed import MISMATCH_CASES, mismatch_data

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # a collective left waiting fails within 30 s instead of hanging
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    z, t, doc, tb = mismatch_data()
    part = slice(rank * 20, rank * 20 + 20)
    out = {}
    for name in @CASES@:
        settings, batch = MISMATCH_CASES[name][rank]
        ev = lmmetrics.Evaluator(**{k: (tb if v == "tb" else v) for k, v in settings.items()})
        if batch != "no batch":
            ev.update(z[part], t[part], document_ids=doc[part] if batch == "documents" else None)
        try:
            out[name] = {"metrics": ev.all_reduce().compute().as_dict()}
        except ValueError as e:
            out[name] = {"error": str(e)}
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def mismatch_data():
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((40, 50)) * 2).astype(np.float32)
    t = rng.integers(-1, 50, 40)
    return z, t, np.arange(40) // 6, rng.integers(0, 4, 50)


#: case: ((rank 0's Evaluator settings, its batch), (rank 1's ...)); "tb" stands for the token_bytes table
MISMATCH_CASES = {
    "documents on one rank": (({}, "documents"), ({}, "plain")),
    "top_k": (({"top_k": (1, 5)}, "plain"), ({"top_k": 1}, "plain")),
    "calibration_bins": (({"calibration_bins": 10}, "plain"), ({"calibration_bins": 15}, "plain")),
    "token_bytes given": (({"token_bytes": "tb"}, "plain"), ({}, "plain")),
    "token_bytes table": (({"token_bytes": "tb"}, "plain"), ({"token_bytes": list(range(50))}, "plain")),
    "softcap": (({"softcap": 30.0}, "plain"), ({}, "plain")),
    "nll_only": (({"nll_only": True}, "plain"), ({}, "plain")),
    "ignore_index": (({"ignore_index": -1}, "plain"), ({}, "plain")),
    "several": (({"top_k": 2, "softcap": 30.0}, "documents"), ({}, "plain")),
    # these sum: a rank without batches goes with either; the group still works after the errors
    "documents, no batch on the other rank": (({}, "documents"), ({}, "no batch")),
    "the same settings": (({"token_bytes": "tb", "top_k": (1, 5), "calibration_bins": 10}, "documents"),
                          ({"token_bytes": "tb", "top_k": (1, 5), "calibration_bins": 10}, "documents")),
}


def _run_cases(names, tmp_path):
    outs = run_gloo_workers(MISMATCH_WORKER.replace("@CASES@", repr(list(names))), tmp_path, timeout=90)
    assert outs[0].keys() == outs[1].keys() == set(names)
    return outs


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_all_reduce_refuses_documents_on_some_ranks_only(tmp_path):
    """tokens would count every rank and the documents only those with ids: a wrong number, refused
    as merge refuses it."""
    outs = _run_cases(["documents on one rank", "documents, no batch on the other rank"], tmp_path)
    for o in outs:
        err = o["documents on one rank"].get("error", "")
        assert "document_ids is given on rank 0, not given on rank 1" in err, o["documents on one rank"]
        assert o["documents on one rank"] == outs[0]["documents on one rank"]
    z, t, doc, _ = mismatch_data()
    whole = lmmetrics.evaluate(z[:20], t[:20], document_ids=doc[:20]).as_dict()
    for o in outs:
        got = o["documents, no batch on the other rank"]["metrics"]
        assert got.keys() == whole.keys() and got["documents"] == 4
        for k, v in whole.items():
            assert got[k] == (v if v is None else pytest.approx(v, rel=1e-12, nan_ok=True)), k


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_all_reduce_refuses_ranks_with_other_settings(tmp_path):
    outs = _run_cases(list(MISMATCH_CASES)[1:], tmp_path)
    expect = {
        "top_k": ["top_k is (1, 5) on rank 0, (1,) on rank 1"],
        "calibration_bins": ["calibration_bins is 10 on rank 0, 15 on rank 1"],
        "token_bytes given": ["token_bytes is a table of 50 counts (digest ", " on rank 0, None on rank 1"],
        "token_bytes table": ["token_bytes is a table of 50 counts (digest ", ") on rank 0, a table of 50 "],
        "softcap": ["softcap is 30.0 on rank 0, None on rank 1"],
        "nll_only": ["nll_only is True on rank 0, False on rank 1"],
        "ignore_index": ["ignore_index is -1 on rank 0, -100 on rank 1"],
        "several": ["softcap is 30.0 on rank 0, None on rank 1; top_k is (2,) on rank 0, None on rank 1; "
                    "document_ids is given on rank 0, not given on rank 1"],
    }
    for name, parts in expect.items():
        for o in outs:
            err = o[name].get("error", "")
            assert err.startswith("Evaluator.all_reduce: the ranks' Evaluators differ: "), (name, o[name])
            assert all(p in err for p in parts), (name, err)
            assert err == outs[0][name]["error"]  # every rank says the same
    z, t, doc, tb = mismatch_data()
    whole = lmmetrics.evaluate(z, t, token_bytes=tb, document_ids=doc, top_k=(1, 5), calibration_bins=10).as_dict()
    for o in outs:  # after the refusals the group still sums
        got = o["the same settings"]["metrics"]
        assert got.keys() == whole.keys()
        for k, v in whole.items():
            assert got[k] == (v if v is None else pytest.approx(v, rel=1e-12, nan_ok=True)), k
        got = o["documents, no batch on the other rank"]["metrics"]
        assert got["documents"] == 4 and got["tokens"] == int(np.count_nonzero(t[:20] >= 0))


# -- an update whose pass failed on one rank's device: every rank raises, none is left waiting ------------

DEVICE_ERROR_WORKER = ROUTED_GLOO_WORKER + textwrap.dedent("""
    import lmmetrics
    from test_distributed import device_error_data

    z, t, bad = device_error_data()
    ev = lmmetrics.Evaluator()
    for k in range(2):
        zz = torch.from_numpy(z[rank, k].copy())
        if (rank, k) == bad:
            zz[3, 5] = float("nan")
        ev.update(zz, torch.from_numpy(t[rank, k]))
    out = {}
    try:
        ev.all_reduce()
    except ValueError as e:
        out["error"] = str(e)
        ev.all_reduce()  # the batches that succeeded, on every rank
    out["metrics"] = ev.compute().as_dict()
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def device_error_data():
    """Two batches a rank, and which one holds a NaN row (rank 1's first)."""
    rng = np.random.default_rng(4)
    z = (rng.standard_normal((2, 2, 8, 30)) * 2).astype(np.float32)
    return z, rng.integers(0, 30, (2, 2, 8)), (1, 0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_all_reduce_raises_on_every_rank_when_a_device_pass_failed_on_one(tmp_path):
    """A batch whose pass on a device found a NaN row raises at the next
    read, all_reduce's too: on that rank alone it would leave the others
    waiting in the collective (or summing with its next all_reduce).
    Every rank raises, naming the failed update; the next all_reduce sums
    the batches that succeeded."""
    outs = run_gloo_workers(DEVICE_ERROR_WORKER, tmp_path, timeout=90)
    named = "update 1 of this Evaluator since it was made or reset"
    assert outs[1]["error"].startswith(named) and "NaN in logits at row 3" in outs[1]["error"], outs[1]
    assert outs[0].get("error", "").startswith("Evaluator.all_reduce: an update failed on rank 1, so nothing "
                                               "was summed"), outs[0]
    assert named in outs[0]["error"] and "NaN in logits at row 3" in outs[0]["error"]
    z, t, _ = device_error_data()
    good = [(0, 0), (0, 1), (1, 1)]
    whole = lmmetrics.evaluate(np.concatenate([z[b] for b in good]), np.concatenate([t[b] for b in good])).as_dict()
    for o in outs:
        assert o["metrics"].keys() == whole.keys()
        for k, v in whole.items():
            assert o["metrics"][k] == (v if v is None else pytest.approx(v, rel=1e-6)), k


# -- all_reduce again: the ranks' own sums, never the global ones an earlier call gave ----------------

AGAIN_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import numpy as np
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    import lmmetrics
    from test_distributed import again_data

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    z, t, doc, tb = again_data()
    mine = [k for k in range(4) if k % world == rank]  # rank 0: batches 0 and 2, rank 1: 1 and 3
    make = lambda: lmmetrics.Evaluator(token_bytes=tb, top_k=(1, 3), calibration_bins=5)
    ev = make()
    ev.update(z[mine[0]], t[mine[0]], document_ids=doc[mine[0]])
    out = {"first": ev.all_reduce().compute().as_dict(), "twice": ev.all_reduce().compute().as_dict()}
    ev.update(z[mine[1]], t[mine[1]], document_ids=doc[mine[1]])  # after all_reduce: to this rank's own sums
    out["own"] = ev.compute().as_dict()
    out["all"] = ev.all_reduce().compute().as_dict()
    other = make()  # a merge after all_reduce likewise
    other.update(z[mine[0]], t[mine[0]], document_ids=doc[mine[0]])
    other.all_reduce()
    side = make()
    side.update(z[mine[1]], t[mine[1]], document_ids=doc[mine[1]])
    out["merged"] = other.merge(side).all_reduce().compute().as_dict()
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def again_data():
    rng = np.random.default_rng(8)
    z = (rng.standard_normal((4, 6, 40)) * 2).astype(np.float32)
    t = rng.integers(-1, 40, (4, 6))
    doc = rng.integers(0, 3, (4, 6))  # documents 0..2 on both ranks
    return z, t, doc, rng.integers(0, 4, 40)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_all_reduce_again_sums_each_batch_once(tmp_path):
    """all_reduce replaced the sums by every rank's: a second call summed
    those again (tokens, bytes and every sum times the world size, the
    standard errors too small), and an update after it then a second
    all_reduce counted the first batches once per rank (a wrong loss). Each
    call sums the ranks' own sums, the batches added since included; an
    update or merge after it adds to the rank's own."""
    outs = run_gloo_workers(AGAIN_WORKER, tmp_path, timeout=90)
    z, t, doc, tb = again_data()

    def whole(ks):
        return lmmetrics.evaluate(z[ks].reshape(-1, 40), t[ks].reshape(-1), token_bytes=tb, top_k=(1, 3),
                                  calibration_bins=5, document_ids=doc[ks].reshape(-1)).as_dict()

    want = {"first": whole([0, 1]), "twice": whole([0, 1]), "all": whole([0, 1, 2, 3]),
            "merged": whole([0, 1, 2, 3])}
    for rank, o in enumerate(outs):
        want["own"] = whole([rank, rank + 2])
        for name, w in want.items():
            assert o[name].keys() == w.keys(), name
            for k, v in w.items():
                assert o[name][k] == (v if v is None else pytest.approx(v, rel=1e-12, nan_ok=True)), (rank, name, k)


# -- evaluate_bpb: a batch that failed on one rank raises on every rank -------------------------------------

BPB_ERROR_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import torch
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    import lmmetrics
    from test_distributed import TinyLM, batches, token_bytes_table

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    tiny, data, tb = TinyLM(), batches(n=4), token_bytes_table()
    calls = []

    def nan_on_rank_1(x):
        calls.append(1)
        z = tiny(x)
        if rank == 1 and len(calls) == 1:
            z[1, 5, 0] = float("nan")  # a counted row of the first batch
        return z

    mine = data[rank * 2:rank * 2 + 2]
    out = {}
    for name, model, part in (("nan", nan_on_rank_1, mine), ("ran out", tiny, mine[:2 - rank]),
                              ("after", tiny, mine)):
        try:
            out[name] = lmmetrics.evaluate_bpb(model, part, 2, tb)
        except ValueError as e:
            out[name] = str(e)
    out["calls"] = len(calls)
    print(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_evaluate_bpb_raises_on_every_rank_when_a_batch_failed_on_one(tmp_path):
    """A NaN row (or batches that ran out) on one rank raised there alone:
    the other rank waited in the all-reduce and summed that rank's next
    evaluation's batches into this one (a wrong bits per byte), then the
    next one waited without a peer. Every rank raises now, the failing
    rank calling the model for its other batches (a sharded model's
    forward holds collectives), and the next evaluation sums as it should."""
    outs = run_gloo_workers(BPB_ERROR_WORKER, tmp_path, timeout=90)
    assert outs[1]["nan"] == "NaN in logits at row 25 (position (1, 5))", outs[1]
    assert outs[0]["nan"] == ("evaluate_bpb: an update failed on rank 1, so nothing was summed (every rank "
                              "raises): rank 1: NaN in logits at row 25 (position (1, 5))"), outs[0]
    assert outs[1]["ran out"] == "evaluate_bpb: batches ran out after 1 of steps=2"
    assert outs[0]["ran out"].startswith("evaluate_bpb: an update failed on rank 1, so nothing was summed")
    assert outs[0]["calls"] == outs[1]["calls"] == 2  # the failing rank read its second batch too
    expected = nanochat_bpb(TinyLM(), batches(n=4), 4, token_bytes_table())
    assert outs[0]["after"] == outs[1]["after"] == pytest.approx(expected, rel=1e-6)
