"""``lmmetrics bench --lazy``: metrics from hidden states and an output head
(lazy logits) against the materialized path, in time and peak memory.

Every variant takes the same seeded hidden states and head:

- ``matmul``: ``hidden @ W.T`` alone, the logits materialized (the FLOPs
  every variant pays; the time to match);
- ``materialized``: the same logits, then ``F.cross_entropy`` (what an
  eval loop does with ``model(x).logits``);
- ``lazy``: ``lmmetrics.evaluate(lmmetrics.projected(hidden, W), targets)``
  (NLL, entropy and accuracy), the head applied a chunk of rows at a time.

- ``lazy-nll``: ``lmmetrics.cross_entropy`` of the same lazy logits (the
  NLL alone: what ``F.cross_entropy`` computes).
- ``lazy-rows`` (on a device only): ``lazy-nll`` with the rows never cut
  into vocabulary blocks (as many whole rows a chunk as the budget holds):
  whether a GPU wants the blocks, whose merge costs a few dozen small
  kernels a block, or fewer rows a matmul.

On the CPU each variant runs in a fresh process and peak memory is the RSS
above the process's memory once its inputs exist. On a CUDA device
(`bench_lazy_device`) the variants run in one process, each warmed up
first (compiles), timed to the device's end, with the peak GPU memory above
the inputs; there ``materialized`` gives the 16-bit logits to
``F.cross_entropy`` as they are (it accumulates in float32 on the device).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import queue
import resource
import sys
import time
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import InputError

VARIANTS = ("matmul", "materialized", "lazy", "lazy-nll")


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


def _inputs(tokens: int, hidden: int, vocab: int, dtype: str, device: Any = "cpu") -> Tuple[Any, Any, Any]:
    """Hidden states, head and targets, seeded (the same values on every device)."""
    import torch

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    h = (torch.randn(tokens, hidden, generator=g) / math.sqrt(hidden)).to(dt).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * 2.0).to(dt).to(device)
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return h, w, t


def _step(name: str, h: Any, w: Any, t: Any, threads: Optional[int]) -> Callable[[], float]:
    """One variant's work, returning its loss (the matmul: a logit)."""
    import torch.nn.functional as F

    import lmmetrics

    upcast = h.device.type == "cpu"  # (torch's CPU cross_entropy of 16-bit logits: float32 first)
    if name == "matmul":
        return lambda: float((h @ w.T)[0, 0])
    if name == "materialized":
        return lambda: float(F.cross_entropy((h @ w.T).float() if upcast else h @ w.T, t))
    if name == "lazy":
        return lambda: lmmetrics.evaluate(lmmetrics.projected(h, w), t, num_threads=threads).loss
    if name == "lazy-nll":
        return lambda: lmmetrics.cross_entropy(lmmetrics.projected(h, w), t, num_threads=threads)

    def whole_rows() -> float:  # lazy-nll with rows never cut into vocabulary blocks
        from ..._engine import chunked as _chunked

        old = _chunked._TILE_ROWS, _chunked._TILE_ROWS_CUDA
        _chunked._TILE_ROWS = _chunked._TILE_ROWS_CUDA = 1
        try:
            return lmmetrics.cross_entropy(lmmetrics.projected(h, w), t, num_threads=threads)
        finally:
            _chunked._TILE_ROWS, _chunked._TILE_ROWS_CUDA = old

    return whole_rows


def _variant(name: str, tokens: int, hidden: int, vocab: int, dtype: str, threads: int,
             results: Any) -> None:
    """One variant, in its own process: puts (seconds, peak extra bytes,
    value), or the message of what it raised."""
    try:
        import torch

        torch.set_num_threads(threads)
        h, w, t = _inputs(tokens, hidden, vocab, dtype)
        fn = _step(name, h, w, t, threads)
        _reset_peak()
        base = _rss_bytes("VmRSS")
        t0 = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - t0
        results.put((seconds, max(0, _rss_bytes("VmHWM") - base), value))
    except Exception as e:  # (the parent says so: it would otherwise wait for a result forever)
        results.put(f"{type(e).__name__}: {' '.join(str(e).split())}")


def run_variant(name: str, tokens: int, hidden: int, vocab: int, dtype: str, threads: int) -> Tuple[float, int, float]:
    """(seconds, peak extra bytes, value) of one variant, in its own process;
    InputError when it fails or dies (out of memory: killed) without one."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_variant, args=(name, tokens, hidden, vocab, dtype, threads, q))
    p.start()
    got: Any = None
    while got is None:
        try:
            got = q.get(timeout=0.5)
        except queue.Empty:
            if not p.is_alive():  # (its last put reaches the queue before it exits)
                try:
                    got = q.get(timeout=1.0)
                except queue.Empty:
                    p.join()
                    raise InputError(f"bench --lazy: the {name} run ended without a result (exit code "
                                     f"{p.exitcode}; killed for memory?) at {tokens} x {vocab}") from None
    p.join()
    if isinstance(got, str):
        raise InputError(f"bench --lazy: the {name} run failed at {tokens} x {vocab} (hidden {hidden}): {got}")
    out: Tuple[float, int, float] = got
    return out


def bench_lazy(tokens: int = 1024, hidden: int = 2048, vocab: int = 128256, dtype: str = "float32",
               threads: int = 2, repeat: int = 2, print_fn: Callable[[str], None] = print) -> int:
    """The CPU table (each variant in its own process, best of ``repeat``,
    alternated); returns 0 when the lazy losses match the materialized one
    within 1e-4 relative, else 1."""
    best: Dict[str, Tuple[float, Optional[int]]] = {}  # seconds, peak bytes
    values: Dict[str, float] = {}
    for _ in range(repeat):
        for name in VARIANTS:  # alternated, best of `repeat`
            s, peak, v = run_variant(name, tokens, hidden, vocab, dtype, threads)
            old = best.get(name)
            best[name] = (min(s, old[0]), max(peak, old[1] or 0)) if old else (s, peak)
            values[name] = v
    return _table(best, values, f"{threads} threads", tokens, hidden, vocab, dtype, print_fn)


def bench_lazy_device(device: Any, tokens: int = 8192, hidden: int = 2048, vocab: int = 128256,
                      dtype: str = "bfloat16", repeat: int = 3, print_fn: Callable[[str], None] = print) -> int:
    """The table on a torch device (CUDA; a CPU device takes the same steps,
    for tests): the variants in this process, each warmed up, best of
    ``repeat`` timed to the device's end, peak GPU memory above the inputs
    (none off CUDA). Returns as `bench_lazy`."""
    import torch

    from .cuda import _timer

    dev = torch.device(device)
    h, w, t = _inputs(tokens, hidden, vocab, dtype, dev)
    measure = _timer(dev, repeat)
    best: Dict[str, Tuple[float, Optional[int]]] = {}
    values: Dict[str, float] = {}
    for name in VARIANTS + ("lazy-rows",):
        fn = _step(name, h, w, t, None)
        values[name] = fn()
        best[name] = measure(fn)
        del fn
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    # torch's cross_entropy of 16-bit logits on a device returns a 16-bit
    # loss: the materialized value is that far from the lazy ones
    rounding = torch.finfo(h.dtype).eps if dev.type != "cpu" and h.element_size() == 2 else 0.0
    return _table(best, values, where, tokens, hidden, vocab, dtype, print_fn, rounding)


def _table(best: Dict[str, Tuple[float, Optional[int]]], values: Dict[str, float], where: str, tokens: int,
           hidden: int, vocab: int, dtype: str, print_fn: Callable[[str], None], rounding: float = 0.0) -> int:
    logits_gib = tokens * vocab * 4 / 2**30
    print_fn(f"lazy logits: {tokens} x {hidden} hidden states, a {vocab} x {hidden} head, {dtype}, "
             f"{where} (the logits would be {logits_gib:.2f} GiB in float32)")
    print_fn(f"{'variant':<14}{'ms':>10}{'x matmul':>10}{'x materialized':>16}{'peak extra':>14}")
    for name in best:
        secs, peak = best[name]
        mib = f"{peak / 2**20:>11.0f} MiB" if peak is not None else f"{'-':>11} MiB"
        print_fn(f"{name:<14}{secs * 1e3:>10.3f}{secs / best['matmul'][0]:>10.3f}"
                 f"{secs / best['materialized'][0]:>16.3f}{mib}")
    lazy_peak, mat_peak = best["lazy"][1], best["materialized"][1]
    if lazy_peak is not None and mat_peak is not None:
        print_fn(f"memory saved by lazy logits: {(mat_peak - lazy_peak) / 2.0**30:.2f} GiB")
    mat = values["materialized"]
    print_fn("loss " + ", ".join(f"{k} {v:.6f}" for k, v in values.items() if k != "matmul"))
    lazy = [values[k] for k in values if k.startswith("lazy")]
    ok = all(abs(v - mat) <= max(1e-4, rounding) * abs(mat) and abs(v - lazy[0]) <= 1e-4 * abs(lazy[0])
             for v in lazy)
    if not ok:
        print_fn("FAILED: a lazy loss differs from the materialized one")
    return 0 if ok else 1
