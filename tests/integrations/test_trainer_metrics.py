"""lmmetrics.transformers.TrainerMetrics in a real transformers Trainer: a
tiny random Llama (V = 300) evaluated on sequences of different lengths,
right-padded, with -100 prompt labels, in every evaluation mode, on one
process and on two DDP ranks (torchrun, gloo, CPU). Every value is checked
against float64 computations from the model's own logits, each sequence run
alone and unpadded.

Run as a script (by torchrun), this file is the ranks' worker."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import lmmetrics  # noqa: E402
from lmmetrics.transformers import TrainerMetrics  # noqa: E402
from helpers import run_threads  # noqa: E402

V = 300
LENGTHS = [9, 40, 5, 23, 17, 31, 12]     # 7 sequences: batches of 2 leave one over (and a repeat on 2 ranks)
PROMPTS = [3, 10, 1, 6, 4, 31, 2]         # labels -100 at these leading positions; sequence 5 counts nothing
BATCH = 2
TOP_K = (1, 40)
BINS = 10
MODES = {"default": {}, "batch_eval_metrics": {"batch_eval_metrics": True},
         "eval_accumulation_steps": {"eval_accumulation_steps": 1},
         "no_concat": {"eval_do_concat_batches": False}}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # peaked predictions: accuracy, ranks and bins worth checking
    return model


def _data(model):
    """The sequences: a random prompt half, then the model's greedy continuation
    (so that many labels are the argmax), with the first PROMPTS[i] labels -100."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = torch.randint(1, V, (n,), generator=g)
        with torch.no_grad():
            for t in range(n // 2, n):
                ids[t] = model(ids[None, :t]).logits[0, -1].argmax()
        labels = ids.clone()
        labels[:p] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    token_bytes = torch.randint(0, 5, (V,), generator=g)
    return rows, token_bytes.tolist()


def _collate(batch):
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = torch.tensor(b["input_ids"]), 1, torch.tensor(b["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _evaluate(model, rows, token_bytes, out_dir, **mode):
    from transformers import Trainer, TrainingArguments

    tm = TrainerMetrics(token_bytes=token_bytes, top_k=TOP_K, calibration_bins=BINS)
    extra = {"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
    args = TrainingArguments(output_dir=str(out_dir), per_device_eval_batch_size=BATCH, report_to="none",
                             disable_tqdm=True, use_cpu=True, save_strategy="no", **extra, **mode)
    trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=_collate, **tm.hooks())
    return trainer.evaluate()


def _clustered(sums, counts):
    g, n = len(counts), sum(counts)
    resid = np.asarray(sums) - sum(sums) / n * np.asarray(counts)
    return math.sqrt(g / (g - 1) * float(resid @ resid)) / n


def _per_token(model, row):
    """One sequence alone, unpadded: its float64 logits at the counted
    positions and their targets."""
    with torch.no_grad():
        z = model(torch.tensor([row["input_ids"]])).logits[0].double().numpy()[:-1]
    y = np.asarray(row["labels"][1:])
    return z[y >= 0], y[y >= 0]


def _nll(z, y):
    logp = z - z.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    return logp, -logp[np.arange(y.size), y]


def _reference(model, rows, token_bytes):
    """Every metric from each sequence alone, unpadded, in float64 numpy."""
    tb = np.asarray(token_bytes)
    nll, correct, entropy, nbytes, rank, conf, seq = [], [], [], [], [], [], []
    for i, r in enumerate(rows):
        z, y = _per_token(model, r)
        logp, token_nll = _nll(z, y)
        target = z[np.arange(y.size), y]
        nll += list(token_nll)
        correct += list(z.argmax(1) == y)
        entropy += list(-(np.exp(logp) * logp).sum(1))
        nbytes += list(tb[y])
        rank += list((z > target[:, None]).sum(1))
        conf += list(np.exp(logp.max(1)))
        seq += [i] * y.size
    nll, correct, entropy = np.array(nll), np.array(correct, float), np.array(entropy)
    nbytes, rank, conf, seq = np.array(nbytes, float), np.array(rank), np.array(conf), np.array(seq)
    n = nll.size
    x = np.where(nbytes > 0, nll, 0.0)
    R = x.sum() / nbytes.sum()
    ids = np.unique(seq)
    per = {name: [v[seq == s].sum() for s in ids]
           for name, v in (("nll", nll), ("x", x), ("bytes", nbytes), ("accuracy", correct), ("entropy", entropy),
                           ("tokens", np.ones(n)))}
    ln2 = math.log(2)
    out = {"tokens": n, "sequences": len(rows),
           "token_loss": nll.mean(), "perplexity": math.exp(nll.mean()),
           "token_loss_stderr": nll.std(ddof=1) / math.sqrt(n),
           "token_loss_stderr_sequences": _clustered(per["nll"], per["tokens"]),
           "bits_per_byte": R / ln2,
           "bits_per_byte_stderr": math.sqrt(n / (n - 1) * ((x - R * nbytes) ** 2).sum()) / nbytes.sum() / ln2,
           "bits_per_byte_stderr_sequences": _clustered(per["x"], per["bytes"]) / ln2,
           "mean_reciprocal_rank": (1 / (rank + 1)).mean(),
           "mean_reciprocal_rank_stderr": (1 / (rank + 1)).std(ddof=1) / math.sqrt(n)}
    for name, v in (("accuracy", correct), ("entropy", entropy)):
        out[name] = v.mean()
        out[name + "_stderr"] = v.std(ddof=1) / math.sqrt(n)
        out[name + "_stderr_sequences"] = _clustered(per[name], per["tokens"])
    for k in TOP_K:
        hit = (rank < k).astype(float)
        out[f"top_{k}_accuracy"] = hit.mean()
        out[f"top_{k}_accuracy_stderr"] = hit.std(ddof=1) / math.sqrt(n)
    edges = np.linspace(0, 1, BINS + 1)
    b = np.minimum(np.searchsorted(edges, conf, side="right") - 1, BINS - 1)
    out["ece"] = sum(abs(correct[b == j].sum() - conf[b == j].sum()) for j in range(BINS)) / n
    return out


def _check(got, want, where):
    got = {k[len("eval_"):]: v for k, v in got.items() if k.startswith("eval_")}
    assert set(want) <= set(got), f"{where}: missing {sorted(set(want) - set(got))}"
    assert "loss" in got and not (set(got) - set(want) - {"loss", "runtime", "samples_per_second",
                                                          "steps_per_second", "model_preparation_time"}), where
    for k, w in want.items():
        if k in ("tokens", "sequences"):
            assert got[k] == w and isinstance(got[k], int), (where, k, got[k], w)
        elif "_stderr" in k:
            assert got[k] == pytest.approx(w, rel=1e-4, abs=1e-12), (where, k)
        else:
            assert got[k] == pytest.approx(w, rel=1e-6, abs=1e-12), (where, k)


@pytest.fixture(scope="module")
def setup():
    model = _model()
    rows, token_bytes = _data(model)
    return model, rows, token_bytes, _reference(model, rows, token_bytes)


def test_the_reference_is_not_trivial(setup):
    ref = setup[3]
    assert 0.3 < ref["accuracy"] < 0.9 and ref["top_40_accuracy"] > ref["accuracy"]
    assert ref["tokens"] == sum(n - max(p, 1) for n, p in zip(LENGTHS, PROMPTS))
    assert ref["token_loss_stderr_sequences"] != pytest.approx(ref["token_loss_stderr"], rel=0.05)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_process_every_mode(setup, mode, tmp_path):
    model, rows, token_bytes, ref = setup
    got = _evaluate(model, rows, token_bytes, tmp_path, **MODES[mode])
    _check(got, ref, mode)


def test_eval_loss_stays_the_trainers(setup, tmp_path):
    """eval_loss is the Trainer's mean of per-batch means (weighted by the
    batch size), not replaced by the token-weighted eval_token_loss."""
    model, rows, token_bytes, ref = setup
    got = _evaluate(model, rows, token_bytes, tmp_path)
    means, sizes = [], []
    for i in range(0, len(rows), BATCH):
        part = rows[i:i + BATCH]
        nll = np.concatenate([_nll(*_per_token(model, r))[1] for r in part])
        means.append(nll.mean())
        sizes.append(len(part))
    assert got["eval_loss"] == pytest.approx(np.dot(means, sizes) / sum(sizes), rel=1e-5)
    assert abs(got["eval_loss"] - got["eval_token_loss"]) > 1e-3


# the folder holding the lmmetrics these tests import (site-packages once
# installed, src/ in a checkout): the worker processes import the same one
_HOME = str(Path(lmmetrics.__file__).resolve().parents[1])


def test_two_ddp_ranks_every_mode(setup, tmp_path):
    """torchrun, 2 CPU ranks over gloo: 7 sequences in batches of 2 a rank, so
    the last step repeats one sequence, which gather_for_metrics drops."""
    model, rows, token_bytes, ref = setup
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "data.json").write_text(json.dumps({"rows": rows, "token_bytes": token_bytes}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([_HOME] + sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           __file__, str(tmp_path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    for mode in MODES:
        by_rank = [json.loads((tmp_path / f"{mode}.{r}.json").read_text()) for r in (0, 1)]
        _check(by_rank[0], ref, f"2 ranks, {mode}")
        assert by_rank[0] == by_rank[1]


def test_padding_rows_are_dropped_and_the_next_evaluation_starts_afresh():
    from types import SimpleNamespace

    tm = TrainerMetrics(top_k=2)
    logits = torch.randn(3, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    rows = tm.preprocess_logits_for_metrics(logits, labels).numpy()
    whole = tm.compute_metrics(SimpleNamespace(predictions=rows, label_ids=None))
    padded = np.concatenate([rows[:2], np.full((2, tm.width), -100.0), rows[2:]])
    assert tm.compute_metrics(SimpleNamespace(predictions=padded, label_ids=None)) == whole
    # batch by batch (a tensor each), then a final call; a stale half-evaluation is not carried over
    assert tm.compute_metrics(SimpleNamespace(predictions=torch.tensor(rows[:1])), compute_result=False) == {}
    assert tm.compute_metrics(SimpleNamespace(predictions=rows), compute_result=None) == whole
    assert tm.compute_metrics(SimpleNamespace(predictions=torch.tensor(rows[:1])), compute_result=False) == {}
    batched = tm.compute_metrics(SimpleNamespace(predictions=[rows[1:]]), compute_result=True)
    assert batched == pytest.approx(whole, rel=1e-12)  # the same sums, added in another order
    assert tm.metrics is not None and tm.metrics.tokens == whole["tokens"] == 15


def test_per_sequence_values_keep_each_sequences_place():
    """per_document.ids is each sequence's place in the gathered order, also
    when a sequence before it counts no token (a prompt-only sample): it
    is left out, and the ids after it are not renumbered."""
    from types import SimpleNamespace

    tm = TrainerMetrics()
    logits = torch.randn(5, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(1))
    labels[1] = -100
    labels[3, 1:] = -100
    rows = tm.preprocess_logits_for_metrics(logits, labels).numpy()
    want = [-torch.log_softmax(logits[i, :-1].double(), -1).gather(-1, labels[i, 1:, None]).mean().item()
            for i in (0, 2, 4)]
    for calls in ([(rows, None)], [(rows[:2], False), (np.full((1, tm.width), -100.0), False), (rows[2:], True)]):
        for part, result in calls:
            out = tm.compute_metrics(SimpleNamespace(predictions=part), compute_result=result)
        assert out["sequences"] == 5
        per = tm.metrics.per_document
        assert per.ids.tolist() == [0, 2, 4]
        np.testing.assert_allclose(per.loss, want, rtol=1e-6)


def test_hooks_called_from_several_threads_at_once():
    """One TrainerMetrics whose hooks several threads call at once: each
    call holds its Evaluator's lock. The rows of a batch were made in the
    Evaluator's sums, cleared before each sequence, and a sequence of
    another thread's batch was summed into them (no error, wrong rows)."""
    import functools
    from types import SimpleNamespace

    tm = TrainerMetrics(top_k=2, calibration_bins=5)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(3, 6, 20, generator=g), torch.randint(0, 20, (3, 6), generator=g)) for _ in range(120)]
    want = [tm.preprocess_logits_for_metrics(z, t) for z, t in data]
    whole = [tm.compute_metrics(SimpleNamespace(predictions=r.numpy())) for r in want]
    rows = [None] * len(data)
    results = [None] * len(data)

    def work(k):
        for i in range(k, len(data), 4):
            rows[i] = tm.preprocess_logits_for_metrics(*data[i])
            results[i] = tm.compute_metrics(SimpleNamespace(predictions=rows[i].numpy()))

    # (threads switch between any two lines)
    run_threads(*[functools.partial(work, k) for k in range(4)], switch=True)
    assert [i for i in range(len(data)) if not torch.equal(rows[i], want[i])] == []
    assert [i for i in range(len(data)) if results[i] != whole[i]] == []


def test_rows_are_each_sequence_alone_from_one_pass(monkeypatch):
    """A batch's rows, from one pass over it, are what an Evaluator holds
    after each sequence alone (an ignored sequence, a counted one, a
    partly ignored one); logits on a device (here CPU tensors routed
    through the CUDA path) are read from the device once a batch."""
    from helpers import HostReads
    from lmmetrics._engine import inputs as _inputs
    from lmmetrics.transformers import _leaves

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 11, generator=g)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    labels[1, :4] = -100
    labels[2, :] = -100
    tm = TrainerMetrics(top_k=2, calibration_bins=5, token_bytes=np.arange(11) % 3)
    rows = tm.preprocess_logits_for_metrics(logits, labels).numpy()
    for b in range(3):
        ev = lmmetrics.Evaluator(shift=True, top_k=2, calibration_bins=5, token_bytes=np.arange(11) % 3)
        ev.update(logits[b].numpy(), labels[b].numpy())
        assert rows[b].tolist() == pytest.approx([1.0] + [v for _, v in _leaves({k: v for k, v in ev.state_dict().items() if k != "settings"})], rel=1e-12), b
    monkeypatch.setattr(_inputs, "is_cuda", lambda x: isinstance(x, torch.Tensor))
    reads = HostReads(monkeypatch)
    with reads as events:
        routed = tm.preprocess_logits_for_metrics(logits, labels)
    assert events == ["cpu", "numpy"], events
    np.testing.assert_allclose(routed.numpy(), rows, rtol=1e-6, atol=1e-9)


def test_a_mixture_of_experts_puts_its_aux_loss_before_the_logits(setup, tmp_path, monkeypatch):
    """With output_router_logits (Mixtral, Qwen2-MoE, OLMoE, ...) the Trainer
    hands the first hook (aux_loss, logits, router_logits): the logits are
    found among them, and every metric is float64's from the model's own
    logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True)).eval()
    seen = []
    first = TrainerMetrics.preprocess_logits_for_metrics
    monkeypatch.setattr(TrainerMetrics, "preprocess_logits_for_metrics",
                        lambda self, logits, labels: seen.append(logits) or first(self, logits, labels))
    rows, token_bytes = setup[1][:4], setup[2]
    got = _evaluate(model, rows, token_bytes, tmp_path)
    assert isinstance(seen[0], tuple) and seen[0][0].dim() == 0 and seen[0][1].dim() == 3  # (the case)
    _check(got, _reference(model, rows, token_bytes), "mixtral")


def test_an_encoder_decoder_model_takes_shift_false(tmp_path):
    """T5's decoder reads its labels shifted right: its logits at t predict
    label t. Scored as a causal LM's (label t + 1) a set's loss came out
    wrong (5.5650 over 24 tokens where the model's own was 5.4612 over 30,
    without -100 labels): the outputs' encoder state now asks for the
    shift, and shift=False gives the model's numbers."""
    from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0, pad_token_id=0)).eval()
    rows = [{"input_ids": torch.randint(1, 97, (7,)), "labels": torch.randint(1, 97, (5,))} for _ in range(6)]
    rows[1]["labels"][3:] = -100

    def collate(batch):
        return {k: torch.stack([b[k] for b in batch]) for k in ("input_ids", "labels")}

    def evaluate(tm):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none",
                                 disable_tqdm=True, use_cpu=True, save_strategy="no")
        return Trainer(model=model, args=args, eval_dataset=rows, data_collator=collate, **tm.hooks()).evaluate()

    with pytest.raises(ValueError, match=r"encoder-decoder.*TrainerMetrics\(shift=False\)"):
        evaluate(TrainerMetrics())
    nll = []
    for i in range(0, len(rows), 2):
        batch = collate(rows[i:i + 2])
        with torch.no_grad():
            z = model(**batch).logits.double()
        y = batch["labels"].reshape(-1)
        nll += torch.nn.functional.cross_entropy(z.reshape(-1, 97)[y >= 0], y[y >= 0], reduction="none").tolist()
    got = evaluate(TrainerMetrics(shift=False))
    assert got["eval_tokens"] == len(nll) == 28
    assert got["eval_token_loss"] == pytest.approx(np.mean(nll), rel=1e-6)


def test_the_logits_among_the_outputs():
    tm = TrainerMetrics()
    labels = torch.zeros(2, 4, dtype=torch.long)
    z, other = torch.randn(2, 4, 7), torch.randn(2, 4, 3)
    want = tm.preprocess_logits_for_metrics(z, labels)
    for outputs in ((torch.tensor(0.5), z, (torch.randn(8, 4),)), [z]):
        assert torch.equal(tm.preprocess_logits_for_metrics(outputs, labels), want)
    # another tensor of the batch beside the logits (an encoder's state?): the shift must be said
    assert torch.equal(TrainerMetrics(shift=True).preprocess_logits_for_metrics((z, other), labels), want)
    with pytest.raises(ValueError, match=r"beside the logits \(2, 4, 7\), a tensor \(2, 4, 3\).*shift=False"):
        tm.preprocess_logits_for_metrics((z, other), labels)
    with pytest.raises(ValueError, match=r"none is shaped so.*ignore_keys"):
        tm.preprocess_logits_for_metrics((torch.tensor(0.5), torch.randn(2, 7)), labels)
    with pytest.raises(ValueError, match=r"\(2, 5, 7\)\), none of which has the labels' \(batch, time\): the "
                                         r"labels must cover the logits' positions"):
        tm.preprocess_logits_for_metrics((torch.tensor(0.5), torch.randn(2, 5, 7)), labels)
    with pytest.raises(ValueError, match=r"\(2, 4, 3\)\), of which 2 are shaped so.*ignore_keys"):
        tm.preprocess_logits_for_metrics((torch.tensor(0.5), z, other), labels)


def test_clear_errors():
    from types import SimpleNamespace

    tm = TrainerMetrics()
    logits = torch.randn(2, 4, 7)
    with pytest.raises(ValueError, match="needs labels"):
        tm.preprocess_logits_for_metrics(logits, None)
    with pytest.raises(ValueError, match="one labels tensor"):
        tm.preprocess_logits_for_metrics(logits, (torch.zeros(2, 4), torch.zeros(2, 4)))
    with pytest.raises(ValueError, match=r"\(batch, time, vocabulary\)"):
        tm.preprocess_logits_for_metrics(logits[0], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="above|>= V|target"):
        tm.preprocess_logits_for_metrics(logits, torch.full((2, 4), 9))
    with pytest.raises(ValueError, match="both hooks"):   # the logits themselves, without the first hook
        tm.compute_metrics(SimpleNamespace(predictions=logits.numpy()))
    rows = tm.preprocess_logits_for_metrics(logits, torch.zeros(2, 4, dtype=torch.long)).numpy()
    with pytest.raises(ValueError, match="both hooks"):   # another TrainerMetrics' rows
        TrainerMetrics(top_k=1).compute_metrics(SimpleNamespace(predictions=rows))
    rows[0, 0] = 2.0
    with pytest.raises(ValueError, match="neither"):
        tm.compute_metrics(SimpleNamespace(predictions=rows))
    with pytest.raises(ValueError, match="top_k"):
        TrainerMetrics(top_k=0)


def test_importing_lmmetrics_imports_no_transformers():
    code = ("import sys, lmmetrics, lmmetrics.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    env = dict(os.environ, PYTHONPATH=_HOME)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def _worker(out):
    import torch.distributed as dist

    out = Path(out)
    data = json.loads((out / "data.json").read_text())
    model = _model()
    model.load_state_dict(torch.load(out / "model.pt"))
    for mode, kwargs in MODES.items():
        metrics = _evaluate(model, data["rows"], data["token_bytes"], out / "trainer", **kwargs)
        metrics = {k: v for k, v in metrics.items() if not k.endswith(("runtime", "per_second", "_time"))}
        (out / f"{mode}.{dist.get_rank()}.json").write_text(json.dumps(metrics))
    # The Trainer (through accelerate) made the process group; left for the
    # interpreter's teardown, gloo's worker threads can still hold tensors
    # then and a rank dies with SIGABRT ("terminate called without an active
    # exception", seen once in CI): every rank done, then taken down here.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
