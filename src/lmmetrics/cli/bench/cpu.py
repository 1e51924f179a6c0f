"""``lmmetrics bench`` on the CPU: the native kernel against the memory speed
of this machine and against torch.

Every speed is a ratio measured in the same run, the two timed alternately:
the ratio of the best times, and the median of the neighbours' ratios (a
shared host's memory speed drifts from second to second): the kernel's time against the fastest
read-only pass over the same buffer (each SIMD path's float max loop with
eight chains, with and without a software prefetch: the fastest is used,
and named), for one thread and for all threads, in each dtype; ``evaluate``
and the NLL with each target's rank against the NLL alone; ``kl_divergence`` against a read of both buffers;
the NLL against torch's eager ``F.cross_entropy`` and, when asked
(``compile=True``: a compile per dtype, tens of seconds each), the same
function under ``torch.compile``, at each thread count; and the small call
(one row) against torch's ``F.cross_entropy``.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from ... import _core, _engine
from ..errors import InputError
from ..._engine.types import I64Array

from ...evaluation import evaluate
from ...metrics import cross_entropy, kl_divergence

DTYPES = ("float32", "bfloat16", "float16", "float64")
SMALL_VOCAB = 32000  # the small call: one row of a Llama-2-sized vocabulary


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The best of `repeat` timed calls of fn (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_logits(tokens: int, vocab: int, dtype: str, seed: int = 0, scale: float = 3.0) -> npt.NDArray[Any]:
    """Synthetic logits (normal, `scale`) in the asked dtype, as numpy."""
    rng = np.random.default_rng(seed)
    z = np.empty((tokens, vocab), np.float32)
    for i in range(0, tokens, 256):
        z[i:i + 256] = rng.standard_normal((min(256, tokens - i), vocab), dtype=np.float32) * scale
    if dtype == "float32":
        return z
    if dtype in ("float16", "float64"):
        return z.astype(dtype)
    try:
        import ml_dtypes
    except ImportError:
        raise InputError("bfloat16 logits need ml_dtypes (pip install ml_dtypes)") from None
    return z.astype(ml_dtypes.bfloat16)


def reference_sum(z: npt.NDArray[Any], targets: I64Array) -> float:
    """Summed NLL in float64, chunk by chunk (numpy only)."""
    total = 0.0
    for i in range(0, z.shape[0], 128):
        c = z[i:i + 128].astype(np.float64)
        m = c.max(axis=1)
        lse = m + np.log(np.exp(c - m[:, None]).sum(axis=1))
        total += float((lse - c[np.arange(c.shape[0]), targets[i:i + 128]]).sum())
    return total


def read_pass(buffers: Sequence[npt.NDArray[Any]], threads: int, repeat: int) -> Tuple[Callable[[], None], str]:
    """The fastest read-only pass over `buffers` among every SIMD path's max
    loop, plain and prefetching (each timed `repeat` times): (a function
    doing it, its name)."""
    found: List[Tuple[float, str, Callable[[], None]]] = []
    for isa in (i for i in _core.ISAS if _core.isa_supported(i)):
        for prefetch in (False, True):
            def run(isa: str = isa, prefetch: bool = prefetch) -> None:
                for b in buffers:
                    _core.read_pass(b.__array_interface__["data"][0], b.nbytes, threads, isa, prefetch)
            found.append((best_time(run, repeat), isa + (" + prefetch" if prefetch else ""), run))
    _, name, fn = min(found, key=lambda f: f[0])
    return fn, name


def _nll_and_rank(z: npt.NDArray[Any], targets: I64Array, threads: int) -> None:
    """The NLL and each target's rank in one pass (what top-k accuracy
    and the reciprocal rank read)."""
    _engine.run(z, targets, num_threads=threads, nll=True, rank=True)


def paired(base: Callable[[], object], fn: Callable[[], object], repeat: int) -> Tuple[float, float, float]:
    """base and fn timed alternately `repeat` times (the host's speed drifts
    between runs: a ratio is taken between neighbours): the best time of
    each and the median of the ratios base / fn."""
    base()
    fn()
    tb, tf, ratios = float("inf"), float("inf"), []
    for _ in range(repeat):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        tb, tf = min(tb, t1 - t0), min(tf, t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return tb, tf, float(np.median(ratios))


def _torch_logits(z: npt.NDArray[Any]) -> Any:
    import torch

    if z.dtype.name == "bfloat16":
        return torch.from_numpy(z.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(z)


def _torch() -> Any:
    """torch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_cross_entropy(compiled: bool) -> Optional[Callable[[Any, Any], Any]]:
    """torch's F.cross_entropy (sum), under torch.compile when `compiled`;
    None without torch (or torch.compile)."""
    torch = _torch()
    if torch is None or (compiled and not hasattr(torch, "compile")):
        return None

    def ce(z: Any, t: Any) -> Any:
        return torch.nn.functional.cross_entropy(z, t, reduction="sum")
    return torch.compile(ce) if compiled else ce


def torch_time(fn: Optional[Callable[[Any, Any], Any]], z: npt.NDArray[Any], targets: I64Array,
               threads: int, repeat: int) -> Optional[float]:
    """The best time of fn (torch_cross_entropy's) on the same logits,
    None without fn or when torch cannot run it (an older torch without
    this dtype on the CPU; torch.compile without a working compiler)."""
    torch = _torch()
    if fn is None or torch is None:
        return None
    torch.set_num_threads(threads)
    zt, tt = _torch_logits(z), torch.from_numpy(targets)
    try:
        return best_time(lambda: fn(zt, tt), repeat)
    except Exception:  # torch's errors vary by version and backend
        return None


def small_call(repeat: int) -> Tuple[float, Optional[float], Optional[float]]:
    """Per-call time of cross_entropy on one row of SMALL_VOCAB float32
    logits, as numpy and as torch tensors, and of torch's F.cross_entropy
    (both None without torch): the best mean over `repeat` batches of 200
    calls."""
    z = make_logits(1, SMALL_VOCAB, "float32", seed=2)
    t = np.array([7], np.int64)

    def per_call(fn: Callable[[], object]) -> float:
        def batch() -> None:
            for _ in range(200):
                fn()
        return best_time(batch, repeat) / 200

    ours = per_call(lambda: cross_entropy(z, t))
    torch = _torch()
    if torch is None:
        return ours, None, None
    zt, tt = torch.from_numpy(z), torch.from_numpy(t)
    return (ours, per_call(lambda: cross_entropy(zt, tt)),
            per_call(lambda: torch.nn.functional.cross_entropy(zt, tt)))


def bench_cpu(tokens: int, vocab: int, dtypes: Sequence[str], threads: int, repeat: int,
              print_fn: Callable[[str], None] = print, compile: bool = False) -> int:
    """Print the table; 1 when a summed NLL is off its float64 reference
    by more than 1e-6 relative."""
    status = 0
    have_torch = _torch() is not None
    eager = torch_cross_entropy(False)
    compiled = torch_cross_entropy(True) if compile else None
    counts = " and ".join(str(n) for n in sorted({1, threads}))
    print_fn(f"lmmetrics bench: {tokens} x {vocab} logits, SIMD path {_core.active_isa()}, "
             f"{counts} thread(s); read-only pass = the fastest of each SIMD path's max loop, "
             "plain or prefetching (named); \"of read\" = best time / best time, \"median\" = the "
             "median ratio of runs timed alternately")
    if not have_torch:
        print_fn("torch is not installed, so there is no \"vs torch\" column or torch row")
    elif compiled is None:
        print_fn("(--compile adds a \"vs compile\" column: torch.compile of the same F.cross_entropy)")
    head = (f"{'':30} {'time ms':>9} {'GB/s':>7} {'of read':>8} {'median':>7}" +
            (f" {'vs torch':>9}" if have_torch else "") + (f" {'vs compile':>10}" if compiled else ""))
    targets = np.random.default_rng(1).integers(0, vocab, tokens)
    for dtype in dtypes:
        try:
            z = make_logits(tokens, vocab, dtype)
        except InputError as e:
            if len(dtypes) == 1:
                raise
            print_fn("")
            print_fn(f"{dtype}: skipped ({e})")
            continue
        total = cross_entropy(z, targets, reduction="sum", num_threads=threads)
        ref = reference_sum(z, targets)
        rel = abs(total - ref) / abs(ref)
        print_fn("")
        print_fn(f"{dtype} ({z.nbytes / 1e9:.2f} GB): summed NLL {total:.6f}, float64 reference {ref:.6f}, "
                 f"relative error {rel:.1e}")
        print_fn(head)
        if rel > 1e-6:
            print(f"error: the {dtype} result is off the float64 reference by {rel:.1e}", file=sys.stderr)
            status = 1
        torch_rows = []
        for n in sorted({1, threads}):
            read_fn, name = read_pass([z], n, 2)
            nll_fn = functools.partial(cross_entropy, z, targets, reduction="sum", num_threads=n)
            read, nll, frac = paired(read_fn, nll_fn, repeat)
            tt = torch_time(eager, z, targets, n, max(1, repeat // 2))
            tc = torch_time(compiled, z, targets, n, max(1, repeat // 2))
            vs = (f" {tt / nll:8.1f}x" if tt is not None else f" {'-':>9}" if have_torch else "") + \
                 (f" {tc / nll:9.2f}x" if tc is not None else f" {'-':>10}" if compiled else "")
            print_fn(f"{'read-only pass, ' + str(n) + ' thread(s)':30} {read * 1e3:9.2f} "
                     f"{z.nbytes / read / 1e9:7.1f} {'':>8} {'':>7}  ({name})")
            print_fn(f"{'cross_entropy, ' + str(n) + ' thread(s)':30} {nll * 1e3:9.2f} "
                     f"{z.nbytes / nll / 1e9:7.1f} {read / nll:8.2f} {frac:7.2f}" + vs)
            torch_rows += [(f"torch F.cross_entropy, {n}", tt), (f"torch.compile, {n}", tc)]
        # nll_fn: the NLL on all threads (the loop's last)
        nll, ev, ev_frac = paired(nll_fn, functools.partial(evaluate, z, targets, num_threads=threads), repeat)
        print_fn(f"{'evaluate, ' + str(threads) + ' thread(s)':30} {ev * 1e3:9.2f} {z.nbytes / ev / 1e9:7.1f} "
                 f"{'':>8} {'':>7}  ({ev / nll:.2f}x cross_entropy, median {1 / ev_frac:.2f}x)")
        nll, rk, rk_frac = paired(nll_fn, functools.partial(_nll_and_rank, z, targets, threads), repeat)
        print_fn(f"{'nll + rank, ' + str(threads) + ' thread(s)':30} {rk * 1e3:9.2f} {z.nbytes / rk / 1e9:7.1f} "
                 f"{'':>8} {'':>7}  ({rk / nll:.2f}x cross_entropy, median {1 / rk_frac:.2f}x)")
        half = tokens // 2
        if half:
            model, reference = z[:half], make_logits(half, vocab, dtype, seed=3)
            read_fn, name = read_pass([model, reference], threads, 2)
            read, kl, kl_frac = paired(read_fn, functools.partial(kl_divergence, model, reference_logits=reference,
                                                                  num_threads=threads), repeat)
            print_fn(f"{'kl_divergence, ' + str(threads) + ' thread(s)':30} {kl * 1e3:9.2f} "
                     f"{2 * model.nbytes / kl / 1e9:7.1f} {read / kl:8.2f} {kl_frac:7.2f}  "
                     f"(of a read of both buffers, {name})")
        for label, tt in torch_rows:
            if tt is not None:
                print_fn(f"{label:30} {tt * 1e3:9.2f} {z.nbytes / tt / 1e9:7.1f}")
        if have_torch and eager is not None and all(tt is None for label, tt in torch_rows[::2]):
            print_fn(f"torch: no CPU {dtype} cross_entropy in this version")
        del z  # one dtype's buffers at a time
        if half:
            del model, reference
    ours, ours_torch, theirs = small_call(repeat)
    print_fn("")
    print_fn(f"small call (1 x {SMALL_VOCAB} float32 cross_entropy): {ours * 1e6:.1f} us"
             + (f", torch F.cross_entropy {theirs * 1e6:.1f} us ({ours / theirs:.2f}x torch); "
                f"of torch tensors {ours_torch * 1e6:.1f} us ({ours_torch / theirs:.2f}x torch)"
                if theirs is not None and ours_torch is not None else ""))
    return status
