"""LanguageModelMetrics logged by a real Lightning Trainer (CPU, two tiny
epochs): ``self.log_dict(metric)`` with ``prefix=``, on_step from forward
and on_epoch from compute, each epoch's values against float64
cross-entropy of the same batches (a missing reset between epochs would mix
them)."""
import csv
import math

import pytest

pytestmark = pytest.mark.peers  # against a heavy peer's own code: pytest -m peers

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")
L = pytest.importorskip("lightning")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lmmetrics.torchmetrics import LanguageModelMetrics  # noqa: E402

V, T, B = 13, 9, 4


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T), generator=g)
    labels = ids.clone()
    labels[::3, :2] = -100  # some positions ignored
    return torch.utils.data.TensorDataset(ids, labels)


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, 16)
        self.head = torch.nn.Linear(16, V)
        self.train_metrics = LanguageModelMetrics(shift=True, prefix="train/", fields=("loss", "perplexity"))
        self.val_metrics = LanguageModelMetrics(shift=True, prefix="val/")
        self.seen = {"train": [], "val": []}  # (epoch, logits, labels) of every batch

    def forward(self, ids):
        return self.head(self.emb(ids))

    def _step(self, batch, stage):
        ids, labels = batch
        logits = self(ids)
        self.seen[stage].append((self.current_epoch, logits.detach().clone(), labels.clone()))
        return logits, labels

    def training_step(self, batch, _):
        logits, labels = self._step(batch, "train")
        self.train_metrics(logits, labels)  # forward: the batch's value, accumulated
        self.log_dict(self.train_metrics, on_step=True, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

    def validation_step(self, batch, _):
        logits, labels = self._step(batch, "val")
        self.val_metrics.update(logits, labels)
        self.log_dict(self.val_metrics)  # on_epoch, as Lightning defaults in validation
        self.log("val_ppl", self.val_metrics["perplexity"])  # one field, by itself

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def reference(batches):
    """float64 cross-entropy (and more) of the batches, labels shifted."""
    z = torch.cat([b[1][:, :-1] for b in batches]).double().reshape(-1, V)
    t = torch.cat([b[2][:, 1:] for b in batches]).reshape(-1)
    c = t != -100
    nll = torch.nn.functional.cross_entropy(z, t, ignore_index=-100, reduction="sum").item()
    n = int(c.sum())
    logp = torch.log_softmax(z, -1)
    return {"loss": nll / n, "perplexity": math.exp(nll / n), "tokens": n, "ignored": int((~c).sum()),
            "nll_sum": nll, "accuracy": (z.argmax(-1) == t)[c].double().mean().item(),
            "entropy": -(logp.exp() * logp).sum(-1)[c].mean().item(), "bits_per_token": nll / n / math.log(2)}


def test_trainer_logs_each_epoch(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    loader = torch.utils.data.DataLoader(data(12, 1), batch_size=B)
    val_loader = torch.utils.data.DataLoader(data(8, 2), batch_size=B)
    logger = CSVLogger(tmp_path, name="run")
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(model, loader, val_loader)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def logged(name):
        return [(int(r["epoch"]), float(r[name])) for r in rows if r.get(name)]

    for stage, names, suffix in (("val", ("loss", "perplexity", "tokens", "ignored", "nll_sum", "accuracy",
                                          "entropy", "bits_per_token"), ""),
                                 ("train", ("loss", "perplexity"), "_epoch")):
        for name in names:
            got = logged(f"{stage}/{name}{suffix}")
            assert [e for e, _ in got] == [0, 1], (stage, name, got)
            for epoch, value in got:
                want = reference([b for b in model.seen[stage] if b[0] == epoch])[name]
                assert value == pytest.approx(want, rel=1e-6, abs=1e-9), (stage, name, epoch)
    assert "val/bits_per_byte" not in rows[0] and "val/kl" not in rows[0]
    ppl = logged("val_ppl")
    assert ppl == logged("val/perplexity")
    # the two epochs differ (the model learned), so a missing reset would have shown
    assert ppl[0][1] != pytest.approx(ppl[1][1], rel=1e-3)
    # on_step values: each training batch's own value (forward)
    steps = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(steps) == len(model.seen["train"]) == 6
    for value, batch in zip(steps, model.seen["train"]):
        assert value == pytest.approx(reference([batch])["loss"], rel=1e-6)
    assert trainer.callback_metrics["val/perplexity"].item() == pytest.approx(ppl[1][1], rel=1e-12)
