"""lmmetrics.torchmetrics against torchmetrics' own Perplexity and nanochat's
bits per byte, as torchmetrics Metrics (update / forward / compute / reset,
state sync across two gloo processes)."""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

torch = pytest.importorskip("torch")
tm = pytest.importorskip("torchmetrics")
from torchmetrics.text import Perplexity as TMPerplexity  # noqa: E402

import lmmetrics  # noqa: E402
from lmmetrics.torchmetrics import BitsPerByte, LanguageModelMetrics, Perplexity  # noqa: E402
from helpers import ROUTED_GLOO_WORKER, run_gloo_workers, run_threads  # noqa: E402
from test_distributed import nanochat_bpb  # noqa: E402

V = 211


def batches(n=3, B=2, T=17, seed=0, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        z = torch.randn(B, T, V, generator=g) * 3
        t = torch.randint(0, V, (B, T), generator=g)
        t[i % B, : 3 + i] = ignore
        out.append((z, t))
    return out


def test_import_lmmetrics_imports_neither_torch_nor_torchmetrics():
    code = "import sys, lmmetrics; assert 'torch' not in sys.modules and 'torchmetrics' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_perplexity_matches_torchmetrics():
    ours, theirs = Perplexity(ignore_index=-100), TMPerplexity(ignore_index=-100)
    assert isinstance(ours, tm.Metric)
    for z, t in batches():
        b_ours, b_theirs = ours(z, t), theirs(z, t)  # forward: the batch's value
        assert b_ours.item() == pytest.approx(b_theirs.item(), rel=1e-5)
    assert ours.compute().item() == pytest.approx(theirs.compute().item(), rel=1e-5)
    assert ours.compute().dtype == torch.float64 and ours.nll_sum.dtype == torch.float64
    ours.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert ours.tokens.item() == 0 and torch.isnan(ours.compute())
    z, t = batches(n=1, seed=4)[0]
    ours.update(z, t)
    theirs.reset()
    theirs.update(z, t)
    assert ours.compute().item() == pytest.approx(theirs.compute().item(), rel=1e-5)


def test_perplexity_without_ignore_index_and_with_hf_labels():
    z, t = batches(n=1, ignore=0)[0]
    assert Perplexity()(z, t).item() == pytest.approx(TMPerplexity()(z, t).item(), rel=1e-5)
    # unshifted labels (shift=True) = torchmetrics on the shifted view
    m = Perplexity(shift=True)
    m.update(z, t)
    assert m.compute().item() == pytest.approx(TMPerplexity(ignore_index=-100)(z[:, :-1], t[:, 1:]).item(),
                                               rel=1e-5)


@pytest.mark.parametrize("kind", ["Perplexity", "LanguageModelMetrics", "BitsPerByte"])
def test_a_model_output_needs_shift_said(kind):
    """A model output comes with its unshifted input ids: without shift= the
    classes refuse it (as evaluate and Evaluator do), never score position t
    against ids[t]."""
    from types import SimpleNamespace

    z, ids = batches(n=1, ignore=0)[0]
    two_bytes = np.full(z.shape[-1], 2)
    make = {"Perplexity": Perplexity, "LanguageModelMetrics": LanguageModelMetrics,
            "BitsPerByte": lambda **kw: BitsPerByte(two_bytes, **kw)}[kind]
    out = SimpleNamespace(logits=z)  # what a Hugging Face model returns: .logits
    with pytest.raises(ValueError, match="say shift=True"):
        make()(out, ids)
    m = make(shift=True)
    m.update(out, ids)
    got = m.compute()
    loss = math.log(TMPerplexity()(z[:, :-1], ids[:, 1:]).item())  # torchmetrics on the shifted view
    want = {"Perplexity": math.exp(loss), "LanguageModelMetrics": loss, "BitsPerByte": loss / (2 * math.log(2))}[kind]
    got = got["loss"] if kind == "LanguageModelMetrics" else got
    assert float(got) == pytest.approx(want, rel=1e-5)
    # plain tensors keep their meaning: aligned targets unless told otherwise
    assert make()(z, ids) is not None


def test_bits_per_byte_matches_nanochat():
    tb = torch.randint(0, 5, (V,), generator=torch.Generator().manual_seed(3))
    tb[:2] = 0
    data = batches(ignore=-1)
    m = BitsPerByte(tb, ignore_index=-1)
    for z, t in data:
        m.update(z, t)
    identity = lambda x: x  # noqa: E731
    want = nanochat_bpb(identity, data, len(data), tb)
    assert m.compute().item() == pytest.approx(want, rel=1e-6)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert BitsPerByte(tb).compute().item() == float("inf")


def test_language_model_metrics_collection():
    data = batches()
    tb = np.arange(V) % 3
    m = LanguageModelMetrics(token_bytes=tb)
    theirs = TMPerplexity(ignore_index=-100)
    for z, t in data:
        batch = m(z, t, reference_logits=z + 0.5 * torch.sin(z))
        assert set(batch) >= {"loss", "perplexity", "accuracy", "entropy", "bits_per_byte", "kl", "same_top"}
        theirs.update(z, t)
    with pytest.raises(TypeError):
        m.update(z, t, z)  # the reference is keyword-only
    got = m.compute()
    assert got["perplexity"].item() == pytest.approx(theirs.compute().item(), rel=1e-5)
    z = torch.cat([b[0] for b in data])
    t = torch.cat([b[1] for b in data])
    logp = torch.log_softmax(z.double(), -1)
    c = t >= 0
    assert got["accuracy"].item() == pytest.approx((z.argmax(-1) == t)[c].double().mean().item())
    assert got["entropy"].item() == pytest.approx(-(logp.exp() * logp).sum(-1)[c].mean().item(), rel=1e-6)
    assert got["tokens"].item() == int(c.sum())


def test_states_move_with_to():
    m = Perplexity().to(torch.device("cpu"))
    z, t = batches(n=1)[0]
    m.update(z, t)
    before = m.compute().item()
    for m2 in (m.to(torch.float32), m.half()):  # the sums must not round
        assert m2.nll_sum.dtype == m2.tokens.dtype == torch.float64
        assert m2.compute().item() == pytest.approx(before, rel=1e-7)  # torchmetrics casts the output
    if torch.cuda.is_available():
        mc = Perplexity(ignore_index=-100).to("cuda")
        mc.update(z.cuda(), t.cuda())
        assert mc.nll_sum.device.type == "cuda" and mc.compute().device.type == "cuda"
        assert mc.compute().item() == pytest.approx(m.compute().item(), rel=1e-6)


def test_cached_results_do_not_round_under_to_dtype():
    """compute() and forward() cache their results; ``.to(dtype)`` must not
    round the cached float64 values either (272.14 must not come back as
    bfloat16's 272.0)."""
    z, t = batches(n=1)[0]  # a perplexity in the hundreds, where bfloat16 keeps 2-3 digits
    logp = torch.log_softmax(z.double(), -1)
    c = t >= 0
    nll = -logp.gather(-1, t.clamp(min=0)[..., None])[..., 0][c]
    ppl = math.exp(nll.mean().item())
    assert ppl > 100 and float(torch.tensor(ppl).to(torch.bfloat16)) != pytest.approx(ppl, rel=1e-4)
    for metric, value in ((Perplexity(), lambda r: r), (LanguageModelMetrics(), lambda r: r["perplexity"])):
        batch = metric(z, t)  # forward caches the batch's value
        metric.compute()  # compute caches the total
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            metric = metric.to(dtype)
            for got in (value(metric.compute()), value(metric._forward_cache)):
                assert got.dtype == torch.float64
                assert got.item() == pytest.approx(ppl, rel=1e-6)
        assert value(batch).item() == pytest.approx(ppl, rel=1e-6)


WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    from lmmetrics.torchmetrics import BitsPerByte, LanguageModelMetrics, Perplexity
    from test_torchmetrics import batches, V

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tb = torch.arange(V) % 4
    metrics = [Perplexity(ignore_index=-100), BitsPerByte(tb), LanguageModelMetrics(token_bytes=tb)]
    data = batches(n=5)
    for z, t in data[:3] if rank == 0 else data[3:]:  # unequal shards
        for m in metrics:
            m.update(z, t)
    ppl, bpb, every = (m.compute() for m in metrics)
    print(json.dumps({"ppl": ppl.item(), "bpb": bpb.item(), "every": {k: v.item() for k, v in every.items()}}))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_sync_across_two_gloo_processes(tmp_path):
    outs = run_gloo_workers(WORKER, tmp_path)
    data = batches(n=5)
    tb = torch.arange(V) % 4
    whole = TMPerplexity(ignore_index=-100)
    single = LanguageModelMetrics(token_bytes=tb)
    for z, t in data:
        whole.update(z, t)
        single.update(z, t)
    want = single.compute()
    for o in outs:  # every rank holds the value over all the data
        assert o["ppl"] == pytest.approx(whole.compute().item(), rel=1e-5)
        assert o["ppl"] == pytest.approx(want["perplexity"].item(), rel=1e-12)
        assert o["bpb"] == pytest.approx(want["bits_per_byte"].item(), rel=1e-12)
        for k, v in want.items():
            assert o["every"][k] == pytest.approx(v.item(), rel=1e-12), k


FAILED_BATCH_WORKER = ROUTED_GLOO_WORKER + textwrap.dedent("""
    from lmmetrics.torchmetrics import Perplexity
    from test_torchmetrics import batches

    metric = Perplexity(ignore_index=-100)
    data = batches(n=4)
    for k, (z, t) in enumerate(data[:2] if rank == 0 else data[2:]):
        if (rank, k) == (1, 1):  # the last update: its pass waits for the next read
            z = z.clone()
            z[0, 1, 3] = float("nan")
        metric.update(z, t)
    out = {}
    try:
        metric.compute()
    except ValueError as e:
        out["error"] = str(e)
    out["ppl"] = metric.compute().item()  # the batches that succeeded, synced
    print(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_a_batch_failed_on_one_rank_raises_on_every_rank(tmp_path):
    """A batch whose pass on a device found a NaN row raises at the next
    read; torchmetrics' sync at compute() raised on that rank alone, before
    the gather, which left the other rank waiting until the timeout. Every
    rank raises now, naming the failure, and the next compute() syncs the
    batches that succeeded."""
    outs = run_gloo_workers(FAILED_BATCH_WORKER, tmp_path, timeout=90)
    assert "NaN in logits" in outs[1]["error"], outs[1]
    assert outs[0]["error"].startswith("Perplexity: an update failed on rank 1, so nothing was synced"), outs[0]
    data = batches(n=4)
    want = TMPerplexity(ignore_index=-100)
    for z, t in data[:3]:
        want.update(z, t)
    for o in outs:
        assert o["ppl"] == pytest.approx(want.compute().item(), rel=1e-5)


OTHER_SETTINGS_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import torch
    import torch.distributed as dist
    sys.path[:0] = [sys.argv[4]]
    from lmmetrics.torchmetrics import BitsPerByte
    from test_torchmetrics import batches, V

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    tb = torch.arange(V) % 4
    data = batches(n=4)
    out = {}
    for name, mine in (("other table", tb * (rank + 1)), ("same table", tb)):
        metric = BitsPerByte(mine)
        for z, t in data[rank * 2:rank * 2 + 2]:
            metric.update(z, t)
        try:
            out[name] = metric.compute().item()
        except ValueError as e:
            out[name] = str(e)
    print(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_ranks_with_other_settings_raise_on_every_rank(tmp_path):
    """Ranks whose metrics had other token_bytes tables synced their sums
    (bytes counted with two tables) and reported a bits per byte of
    neither: the `settings` state is reduced by max, which hid the
    difference. Every rank raises now, naming it, as Evaluator.all_reduce
    does; alike ranks still sync."""
    outs = run_gloo_workers(OTHER_SETTINGS_WORKER, tmp_path, timeout=90)
    for o in outs:
        assert o["other table"].startswith("BitsPerByte: the ranks' metrics differ, their sums cannot be synced: "
                                           "token_bytes is a table of "), o
        assert " on rank 0, a table of " in o["other table"] and o["other table"] == outs[0]["other table"]
    single = BitsPerByte(torch.arange(V) % 4)
    for z, t in batches(n=4):
        single.update(z, t)
    for o in outs:
        assert o["same table"] == pytest.approx(single.compute().item(), rel=1e-12)


def test_language_model_metrics_as_a_mapping_for_log_dict():
    """What Lightning's log_dict reads: items() of prefix + field to metrics
    whose compute() is a tensor and whose reset() resets the shared states."""
    tb = torch.arange(V) % 3
    m = LanguageModelMetrics(token_bytes=tb, prefix="val/")
    assert list(m) == list(m.keys()) == ["val/" + k for k in ("tokens", "ignored", "bytes", "nll_sum", "loss",
                                                              "perplexity", "bits_per_token", "bits_per_byte",
                                                              "accuracy", "entropy")]
    assert len(m) == 10 and "val/loss" in m and "loss" not in m and bool(m)
    assert m["val/loss"] is m["loss"] and dict(m.items())["val/loss"] is m["loss"]
    assert all(isinstance(v, tm.Metric) for v in m.values())
    data = batches()
    for z, t in data:
        batch = m(z, t)
        for k, field in m.items():  # on_step: the batch's value
            assert torch.equal(field._forward_cache, batch[k])
    total = m.compute()
    assert set(m) <= set(total) and all(k.startswith("val/") for k in total)  # compute()'s keys carry the prefix
    assert {"val/loss_stderr", "val/perplexity_low"} <= set(total) - set(m)  # the standard errors, not logged
    for k, field in m.items():
        assert field.compute().dtype == torch.float64 and torch.equal(field.compute(), total[k])
    m["perplexity"].reset()  # resets every field
    assert m.tokens.item() == 0
    with pytest.raises(TypeError, match="update the LanguageModelMetrics"):
        m["loss"].update(*data[0])
    with pytest.raises(KeyError, match="fields= chooses"):
        m["kl"]
    # kl and same_top on request, nan until an update has reference logits
    r = LanguageModelMetrics(fields=["kl", "same_top", "loss"])
    z, t = data[0]
    r.update(z, t)
    assert list(r) == ["kl", "same_top", "loss"] and torch.isnan(r["kl"].compute())
    r.update(z, t, reference_logits=z)
    assert r["kl"].compute().item() == pytest.approx(0, abs=1e-12)
    for bad, err in (([], ValueError), (["perplexity", "perplexity"], ValueError), (["ppl"], ValueError),
                     (["bits_per_byte"], ValueError), ("loss", TypeError)):
        with pytest.raises(err):
            LanguageModelMetrics(fields=bad)
    with pytest.raises(TypeError, match="prefix"):
        LanguageModelMetrics(prefix=None)


def test_standard_errors_stream_through_the_states():
    """The sums of squares are float64 states like the sums: the standard
    errors of two batches equal evaluate's over both, fields= logs them."""
    from lmmetrics.torchmetrics import LanguageModelMetrics

    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 40, 90, generator=g) * 2
    t = torch.randint(0, 90, (2, 40), generator=g)
    m = LanguageModelMetrics(fields=("loss", "loss_stderr", "perplexity_low", "perplexity_high"))
    m.update(z[0], t[0])
    m.update(z[1], t[1])
    whole = lmmetrics.evaluate(z.numpy(), t.numpy())
    got = m.compute()
    assert got["loss_stderr"].item() == pytest.approx(whole.stderr["loss"], rel=1e-12)
    assert got["perplexity_low"].item() == pytest.approx(whole.perplexity_interval[0], rel=1e-12)
    assert dict(m.items())["loss_stderr"].compute().item() == pytest.approx(whole.stderr["loss"], rel=1e-12)


def test_merge_state_of_alike_metrics_only():
    """merge_state adds another metric's sums (or their dict) when they mean
    the same thing, and refuses a metric of another class or settings,
    as Evaluator.merge does; a dict saved without ``settings`` is taken as
    the metric's own."""
    torch.manual_seed(3)
    z, t = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    z2, t2 = torch.randn(3, 4, 11), torch.randint(0, 11, (3, 4))
    want = float(TMPerplexity()(torch.cat([z.reshape(1, 10, 11), z2.reshape(1, 12, 11)], 1),
                                torch.cat([t.reshape(1, 10), t2.reshape(1, 12)], 1)))
    for incoming in ("metric", "dict", "dict without settings"):
        a, b = Perplexity(), Perplexity()
        a.update(z, t)
        b.update(z2, t2)
        state = b.metric_state
        arg = b if incoming == "metric" else state if incoming == "dict" else \
            {k: v for k, v in state.items() if k != "settings"}
        a.merge_state(arg)
        assert float(a.compute()) == pytest.approx(want, rel=1e-6), incoming
    for other in (Perplexity(ignore_index=3), Perplexity(shift=True), LanguageModelMetrics(), BitsPerByte([1] * 11)):
        with pytest.raises(ValueError, match="another class or settings"):
            Perplexity().merge_state(other)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")  # (torchmetrics: loaded, not updated)
@pytest.mark.parametrize("how", ["merge_state metric", "merge_state dict", "load_state_dict"])
def test_compute_after_merge_or_load_gives_the_new_states_value(how):
    """compute() after merge_state or load_state_dict reports the states as
    they are then, not the value computed before (torchmetrics caches
    compute's value until the next update, and neither clears it: the
    perplexity of the batches before the merge came back)."""
    (z1, t1), (z2, t2) = batches(n=2, seed=8)
    both = TMPerplexity(ignore_index=-100)
    both.update(z1, t1)
    both.update(z2, t2)
    want_both, want_second = float(both.compute()), float(TMPerplexity(ignore_index=-100)(z2, t2))
    for cls in (Perplexity, LanguageModelMetrics):
        a, b = cls(ignore_index=-100), cls(ignore_index=-100)
        a.update(z1, t1)
        b.update(z2, t2)
        before = a.compute()  # (cached by torchmetrics)
        if how == "load_state_dict":
            b.persistent(True)
            a.load_state_dict(b.state_dict())
            want = want_second
        else:
            a.merge_state(b if how == "merge_state metric" else b.metric_state)
            want = want_both
        got = a.compute()
        got, before = (got["perplexity"], before["perplexity"]) if cls is LanguageModelMetrics else (got, before)
        assert float(got) == pytest.approx(want, rel=1e-5), (cls.__name__, float(got), float(before))
        if cls is LanguageModelMetrics:
            assert float(a["perplexity"].compute()) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("full_state_update", [False, True])
def test_a_failed_forward_leaves_the_batches_before_it(full_state_update):
    """forward of a batch with NaN logits raises naming the row, and the
    metric keeps the batches before it (torchmetrics' forward resets the
    states to score the batch alone: they were left reset, every batch
    before it lost); the next batches then add to them."""
    (z1, t1), (z2, t2), (z3, t3) = batches(seed=5)
    bad = z2.clone()
    bad[1, 4, 7] = float("nan")
    for cls in (Perplexity, LanguageModelMetrics):  # full_state_update: torchmetrics' forward that updates twice
        ours = type(cls.__name__, (cls,), {"full_state_update": full_state_update})(ignore_index=-100)
        theirs = TMPerplexity(ignore_index=-100)
        ours(z1, t1)
        theirs.update(z1, t1)
        with pytest.raises(ValueError, match=r"NaN in logits at row \d+ \(position \(1, 4\)\)"):
            ours(bad, t2)
        ours(z3, t3)
        theirs.update(z3, t3)
        got = ours.compute()
        got = got["perplexity"] if isinstance(got, dict) else got
        assert got.item() == pytest.approx(theirs.compute().item(), rel=1e-5)
        assert ours.nll_sum.dtype == torch.float64


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")  # (torchmetrics: loaded, not updated)
def test_load_state_dict_of_alike_metrics_only():
    """A state dict loads into a metric made as the one that saved it, and
    is refused, nothing loaded, from a metric of another class or settings:
    a Perplexity's sums hold no entropy nor accuracy, which a
    LanguageModelMetrics loading them reported as 0 (and a BitsPerByte as
    inf: no bytes)."""
    z, t = batches(n=1, seed=6)[0]
    saved = Perplexity()
    saved.persistent(True)
    saved.update(z, t)
    state = saved.state_dict()
    same = Perplexity()
    same.load_state_dict(state)
    assert float(same.compute()) == pytest.approx(float(TMPerplexity(ignore_index=-100)(z, t)), rel=1e-5)
    z2, t2 = batches(n=1, seed=7)[0]
    for other in (LanguageModelMetrics(), BitsPerByte([1] * V), Perplexity(ignore_index=3), Perplexity(shift=True)):
        other.update(z2, t2)
        before = other.compute()
        with pytest.raises(ValueError, match="another class or settings"):
            other.load_state_dict(state)
        after = other.compute()
        assert (after == before if isinstance(before, torch.Tensor) else after.keys() == before.keys()
                and all(after[k].equal(before[k]) or after[k].isnan() for k in after))


def test_bits_per_byte_needs_its_table_when_made():
    """BitsPerByte(None) raises when made; it took batches and raised only at
    compute (in Lightning, at the end of the epoch), naming an Evaluator."""
    with pytest.raises(TypeError, match="BitsPerByte needs token_bytes"):
        BitsPerByte(None)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")  # (a read before any update)
def test_one_metric_used_from_several_threads_adds_every_batch_once():
    """Threads updating one metric (update and forward) while others read it
    (compute, metric_state, deepcopy, pickle): each call runs while it holds
    the metric's lock, so every batch is added once and a read sees whole
    batches, as torchmetrics' own Perplexity gives; the update moved the
    Evaluator's sums into the states in two steps, and a batch another
    thread added between them was lost."""
    import copy
    import functools
    import pickle

    data = [(torch.from_numpy(z), torch.from_numpy(t)) for z, t in (
        (np.random.default_rng(k).standard_normal((2, 3, 9)).astype(np.float32),
         np.random.default_rng(k).integers(0, 9, (2, 3))) for k in range(240))]
    for make in (Perplexity, lambda: LanguageModelMetrics(token_bytes=torch.arange(1, 10))):
        serial, shared = make(), make()
        for z, t in data:
            serial.update(z, t)

        def update(k):
            for i, (z, t) in enumerate(data[k::4]):
                shared(z, t) if i % 3 == 0 else shared.update(z, t)

        def read():
            for _ in range(20):
                shared.compute()
                for tokens in (shared.metric_state["tokens"], copy.deepcopy(shared).tokens,
                               pickle.loads(pickle.dumps(shared)).tokens):
                    assert float(tokens) % 6 == 0, float(tokens)

        # (threads switch between any two lines)
        run_threads(*[functools.partial(update, k) for k in range(4)], read, read, switch=True)
        got, want = shared.compute(), serial.compute()
        assert float(shared.tokens) == 240 * 6
        for k, v in (want.items() if isinstance(want, dict) else [("perplexity", want)]):
            w = got[k] if isinstance(got, dict) else got
            assert float(w) == pytest.approx(float(v), rel=1e-12, abs=1e-15), k
