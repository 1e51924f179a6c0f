"""Host memory of a Hugging Face Trainer's evaluate() with and without
lmmetrics.transformers.TrainerMetrics, on a random 1-layer Llama with a
32000-token vocabulary (CPU).

Each variant runs in its own process: a warm-up evaluate() on one batch, then
the resident set size (RSS, /proc/self/statm, sampled every 2 ms) before and
at its peak during evaluate() of the whole set.

- logits: no preprocess_logits_for_metrics; compute_metrics takes the
  accumulated (N, T, V) logits (float32 cross-entropy and argmax accuracy).
- argmax: the recipe of transformers' run_clm.py (preprocess returns the
  argmax; perplexity = exp(eval_loss), the Trainer's mean of batch means).
- lmmetrics: Trainer(..., **TrainerMetrics().hooks()).

Run (Linux)::

    python benchmarks/trainer_memory.py                      # 64 sequences x 256 tokens, batch 8
    python benchmarks/trainer_memory.py --sequences 32       # smaller
"""
import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

VARIANTS = ("logits", "argmax", "lmmetrics")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The highest RSS seen while in the with block, sampled every 2 ms."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def run(variant, n, length, vocab, batch):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from lmmetrics.transformers import TrainerMetrics

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4)).eval()
    ids = torch.randint(0, vocab, (n, length))
    rows = [{"input_ids": x, "labels": x} for x in ids]

    if variant == "lmmetrics":
        hooks = TrainerMetrics().hooks()
    elif variant == "argmax":
        def compute_metrics(p):
            pred, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
            mask = labels != -100
            return {"accuracy": float((pred == labels)[mask].mean())}

        hooks = {"preprocess_logits_for_metrics": lambda logits, labels: logits.argmax(-1),
                 "compute_metrics": compute_metrics}
    else:
        def compute_metrics(p):
            logits = torch.from_numpy(p.predictions)[:, :-1]
            labels = torch.from_numpy(p.label_ids)[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
            mask = labels != -100
            acc = (logits.argmax(-1) == labels)[mask].double().mean()
            return {"token_loss": loss.item(), "perplexity": math.exp(loss.item()), "accuracy": acc.item()}

        hooks = {"compute_metrics": compute_metrics}
    args = TrainingArguments(output_dir="/tmp/trainer_memory", per_device_eval_batch_size=batch, report_to="none",
                             disable_tqdm=True, use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, eval_dataset=rows, **hooks)
    trainer.evaluate(eval_dataset=rows[:batch])  # warm-up: imports, first allocations
    before = _rss()
    t0 = time.perf_counter()
    with _Peak() as peak:
        metrics = trainer.evaluate()
    seconds = time.perf_counter() - t0
    ppl = metrics.get("eval_perplexity", math.exp(metrics["eval_loss"]))
    return {"variant": variant, "rss_before_mib": before / 2**20, "peak_increase_mib": (peak.peak - before) / 2**20,
            "seconds": seconds, "perplexity": ppl, "eval_loss": metrics["eval_loss"],
            "logits_mib": n * length * vocab * 4 / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant here, print JSON (else each in its own "
                                                         "process, a table)")
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(run(a.variant, a.sequences, a.length, a.vocab, a.batch)))
        return
    print(f"{a.sequences} sequences x {a.length} tokens, V = {a.vocab}, batch {a.batch}: "
          f"{a.sequences * a.length * a.vocab * 4 / 2**20:.0f} MiB of float32 logits")
    print("| variant | RSS before | peak increase | time | perplexity |")
    print("|---|---:|---:|---:|---:|")
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--sequences", str(a.sequences),
                              "--length", str(a.length), "--vocab", str(a.vocab), "--batch", str(a.batch)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {v} | {r['rss_before_mib']:.0f} MiB | {r['peak_increase_mib']:.0f} MiB | {r['seconds']:.1f} s | "
              f"{r['perplexity']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
