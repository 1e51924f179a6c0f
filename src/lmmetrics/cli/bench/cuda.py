"""``lmmetrics bench --device cuda``: the CUDA path against the speed limit
(a read-only Triton pass over the same buffer) and against
``F.cross_entropy``, for many rows and for few long rows.

For each dtype and shape (``tokens x vocab`` and ``few_rows x vocab``) the
table gives the best time of ``repeat`` runs, the bandwidth (bytes of
logits read / time), the fraction of the read-only pass's bandwidth, the
speed relative to ``F.cross_entropy(reduction="sum")`` on the same tensor,
and the peak GPU memory above the inputs. Each lmmetrics call includes its
synchronisation and the transfer of the per-row values to the host.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple

from ..errors import InputError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
_read: Any = None  # the jitted read_max (a triton JITFunction), once built

#: best seconds of a callable over the repetitions, and the peak GPU memory
#: above what was allocated before it (None off CUDA)
Measure = Callable[[Callable[[], object]], Tuple[float, Optional[int]]]


def _read_kernel() -> Any:
    import triton
    import triton.language as tl

    # (parameters: tl.tensor or tl.constexpr, never Python types, which
    # triton would read as the arguments' types)
    @triton.jit
    def read_max(x_ptr: tl.tensor, out_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr,
                 ITERS: tl.constexpr) -> None:
        """Each program: the max of ITERS * BLOCK consecutive elements."""
        pid = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        for k in range(ITERS):
            i = (pid * ITERS + k) * BLOCK + offs
            acc = tl.maximum(acc, tl.load(x_ptr + i, mask=i < n, other=float("-inf")).to(tl.float32))
        tl.store(out_ptr + pid, tl.max(acc, 0))

    return read_max


def read_pass(x: torch.Tensor, out: Optional[torch.Tensor] = None, block: int = 4096,
              iters: Optional[int] = None) -> torch.Tensor:
    """A read-only pass over x (contiguous): per-program maxima (the
    speed limit a one-read kernel can reach on this device). Each program
    reads iters blocks; by default as many as leave a few thousand programs
    (and one block for small buffers, which then still fill the device)."""
    import torch

    global _read
    if _read is None:
        _read = _read_kernel()
    n = x.numel()
    if iters is None:
        iters = 1
        while iters < 8 and n // (block * iters * 2) >= 4096:
            iters *= 2
    progs = (n + block * iters - 1) // (block * iters)
    if out is None or out.numel() < progs:
        out = torch.empty(progs, dtype=torch.float32, device=x.device)
    _read[(progs,)](x.view(-1), out, n, BLOCK=block, ITERS=iters, num_warps=8)
    return out


def _timer(device: torch.device, repeat: int) -> Measure:
    import torch

    cuda = device.type == "cuda"

    def measure(fn: Callable[[], object]) -> Tuple[float, Optional[int]]:
        fn()  # warm up (compiles)
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        best = float("inf")
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        extra = torch.cuda.max_memory_allocated(device) - base if cuda else None
        return best, extra

    return measure


def bench_cuda(tokens: int = 2048, vocab: int = 128256, dtypes: Iterable[str] = DTYPES, repeat: int = 5,
               few_rows: int = 8, device: Optional[str] = None, print_fn: Callable[[str], object] = print) -> int:
    """Print the table; 0 when every summed NLL is within 1e-6 (relative) of
    a float64 reference, else 1. ``device`` defaults to ``"cuda"`` (a CPU
    device only makes sense under ``TRITON_INTERPRET=1``, for tests).
    Raises InputError (the command's one-line error) without torch, without
    a CUDA device or without triton."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        raise InputError("--device cuda needs torch (with CUDA)") from None

    dev = torch.device(device or "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but torch sees no CUDA device")
    try:
        import triton

        from ..._engine.cuda import triton as _triton
    except ImportError as e:
        raise InputError(f"--device cuda needs triton (pip install triton): {e}") from None

    from ...evaluation import evaluate
    from ...metrics import cross_entropy

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    dtypes = tuple(dtypes)
    layouts = ", ".join(f"{dt} {_triton.geometry(dt)[3]} warps" for dt in dtypes)
    print_fn(f"lmmetrics bench: CUDA path on {name}; triton {triton.__version__}, span {_triton.SPAN} ({layouts})")
    measure = _timer(dev, repeat)
    ok = True
    shapes: List[Tuple[int, int]] = [(tokens, vocab)]
    if few_rows and few_rows != tokens:
        shapes.append((few_rows, vocab))
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n, v in shapes:
            g = torch.Generator(device=dev).manual_seed(0)
            z = (torch.randn(n, v, device=dev, generator=g) * 3).to(dtype)
            r = (z.float() + torch.randn(n, v, device=dev, generator=g) * 0.5).to(dtype)
            t = torch.randint(0, v, (n,), device=dev, generator=g)
            nbytes = z.numel() * z.element_size()
            ref = sum(F.cross_entropy(z[i:i + 256].double(), t[i:i + 256], reduction="sum").item()
                      for i in range(0, n, 256))
            total = cross_entropy(z, t, reduction="sum")
            rel = abs(total - ref) / abs(ref)
            ok &= rel <= 1e-6
            print_fn("")
            print_fn(f"{n} x {v} {dtype_name} ({nbytes / 1e9:.3f} GB): summed NLL {total:.6f}, "
                     f"float64 {ref:.6f}, relative error {rel:.1e}")
            part = torch.empty(1, dtype=torch.float32, device=dev)
            part = read_pass(z, part)
            rows = []
            read_t, read_m = measure(lambda: read_pass(z, part))
            rows.append(("read-only pass (Triton max)", read_t, read_m, 1))
            torch_t, torch_m = measure(lambda: F.cross_entropy(z, t, reduction="sum").item())
            rows.append(("torch F.cross_entropy(sum)", torch_t, torch_m, 1))
            rows.append(("lmmetrics cross_entropy(sum)",
                         *measure(lambda: cross_entropy(z, t, reduction="sum")), 1))
            rows.append(("lmmetrics evaluate (nll+ent+acc)", *measure(lambda: evaluate(z, t)), 1))
            rows.append(("lmmetrics evaluate + reference (KL)",
                         *measure(lambda: evaluate(z, t, reference_logits=r)), 2))
            old = os.environ.get("LMMETRICS_TRITON")
            os.environ["LMMETRICS_TRITON"] = "0"
            try:
                rows.append(("torch path: cross_entropy(sum)",
                             *measure(lambda: cross_entropy(z, t, reduction="sum")), 1))
            finally:
                if old is None:
                    del os.environ["LMMETRICS_TRITON"]
                else:
                    os.environ["LMMETRICS_TRITON"] = old
            print_fn(f"{'':38} {'time ms':>9} {'GB/s':>8} {'of read':>8} {'vs torch':>9} {'extra MiB':>10}")
            for label, sec, mem, reads in rows:
                gbs = reads * nbytes / sec / 1e9
                frac = gbs / (nbytes / read_t / 1e9)
                vs = f"{torch_t / sec:.2f}x" if label.startswith(("lmmetrics", "torch path")) else ""
                mib = f"{mem / 2**20:10.1f}" if mem is not None else f"{'-':>10}"
                print_fn(f"{label:38} {sec * 1e3:9.3f} {gbs:8.1f} {frac:8.2f} {vs:>9} {mib}")
    return 0 if ok else 1
