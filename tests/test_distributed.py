"""Evaluator.all_reduce and evaluate_bpb across two real torch.distributed
processes (gloo over loopback), and evaluate_bpb against nanochat's
algorithm with a tiny torch model."""
import math
import textwrap

import numpy as np
import pytest

import lmmetrics
from helpers import run_gloo_workers

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


def nanochat_bpb(model, data, steps, token_bytes):
    """nanochat's loss_eval.evaluate_bpb, written from its algorithm."""
    total_nats, total_bytes = 0.0, 0
    with torch.no_grad():
        for x, y in data[:steps]:
            logits = model(x).double()
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
