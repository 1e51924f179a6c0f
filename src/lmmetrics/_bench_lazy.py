"""``lmmetrics bench --lazy``: metrics from hidden states and an output head
(lazy logits) against the materialized path, in time and peak memory.

Each variant runs in a fresh process (peak RSS is a process's high-water
mark), on the same seeded hidden states and head:

- ``matmul``: ``hidden @ W.T`` alone, the logits materialized (the FLOPs
  every variant pays; the time to match);
- ``materialized``: the same logits, then ``F.cross_entropy`` (what an
  eval loop does with ``model(x).logits``);
- ``lazy``: ``lmmetrics.evaluate(lmmetrics.projected(hidden, W), targets)``
  (NLL, entropy and accuracy), the head applied a chunk of rows at a time.

Peak memory is reported above the process's memory once its inputs exist.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

VARIANTS = ("matmul", "materialized", "lazy")


def _reset_peak() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux: clear_refs 5);
    False where that is not possible (the peak then includes the setup)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak) from /proc; getrusage's peak elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _variant(name: str, tokens: int, hidden: int, vocab: int, dtype: str, threads: int,
             queue: Any) -> None:
    import torch

    import lmmetrics

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    h = (torch.randn(tokens, hidden, generator=g) / math.sqrt(hidden)).to(dt)
    w = (torch.randn(vocab, hidden, generator=g) * 2.0).to(dt)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    _reset_peak()
    base = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    if name == "matmul":
        logits = h @ w.T
        value = float(logits[0, 0])
    elif name == "materialized":
        logits = h @ w.T
        value = float(torch.nn.functional.cross_entropy(logits.float(), t))
    else:
        m = lmmetrics.evaluate(lmmetrics.projected(h, w), t, num_threads=threads)
        value = m.loss
    seconds = time.perf_counter() - t0
    queue.put((seconds, max(0, _rss_bytes("VmHWM") - base), value))


def run_variant(name: str, tokens: int, hidden: int, vocab: int, dtype: str, threads: int) -> Tuple[float, int, float]:
    """(seconds, peak extra bytes, value) of one variant, in its own process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_variant, args=(name, tokens, hidden, vocab, dtype, threads, q))
    p.start()
    out: Tuple[float, int, float] = q.get()
    p.join()
    return out


def bench_lazy(tokens: int = 1024, hidden: int = 2048, vocab: int = 128256, dtype: str = "float32",
               threads: int = 2, repeat: int = 2, print_fn: Callable[[str], None] = print) -> int:
    """Print the table; returns 0 when the lazy loss matches the materialized
    one (float32 cross-entropy) within 1e-4 relative, else 1."""
    best: Dict[str, List[float]] = {}  # [seconds, peak bytes]
    values: Dict[str, float] = {}
    for _ in range(repeat):
        for name in VARIANTS:  # alternated, best of `repeat`
            s, peak, v = run_variant(name, tokens, hidden, vocab, dtype, threads)
            old = best.get(name)
            best[name] = [min(s, old[0]) if old else s, float(max(peak, old[1]) if old else peak)]
            values[name] = v
    logits_gib = tokens * vocab * 4 / 2**30
    print_fn(f"lazy logits: {tokens} x {hidden} hidden states, a {vocab} x {hidden} head, {dtype}, "
             f"{threads} threads (the logits would be {logits_gib:.2f} GiB in float32)")
    print_fn(f"{'variant':<14}{'seconds':>10}{'x matmul':>10}{'peak extra':>14}")
    for name in VARIANTS:
        secs, peak_bytes = best[name]
        print_fn(f"{name:<14}{secs:>10.3f}{secs / best['matmul'][0]:>10.3f}{peak_bytes / 2**20:>11.0f} MiB")
    saved = (best["materialized"][1] - best["lazy"][1]) / 2.0**30
    print_fn(f"memory saved by lazy logits: {saved:.2f} GiB; loss lazy {values['lazy']:.6f}, "
             f"materialized {values['materialized']:.6f}")
    ok = abs(values["lazy"] - values["materialized"]) <= 1e-4 * abs(values["materialized"])
    if not ok:
        print_fn("FAILED: the lazy loss differs from the materialized one")
    return 0 if ok else 1
