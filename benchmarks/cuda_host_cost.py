"""The host's cost of a small call on the CUDA path, without a GPU.

CPU tensors are routed through the CUDA path and the Triton kernel, which
triton compiles for sm_90 with its driver stubbed (the stub of
tests/cuda/test_triton.py: it loads nothing and records each launch), so a
call does everything a call on a GPU does on the host (describing the
inputs, the launches, the transfer, settling the results) except the
device's own work. Prints the time a call of ``cross_entropy`` over 8 x
128256 bfloat16 logits (best of 5 runs) with the cached launch, through
Triton's own launcher, and with ``sync=False``. The kernel computes
nothing here: the result buffer is zeroed, its flags set to "counted".

Run from the repository root with triton installed:
    PYTHONPATH=src python benchmarks/cuda_host_cost.py [--calls 3000]
For instruction counts (steadier than times on a shared VM), under
valgrind: ``valgrind --tool=callgrind --toggle-collect=functools_reduce
python benchmarks/cuda_host_cost.py --calls 200 --once`` counts the 200
calls made inside ``functools.reduce`` (callgrind's total / 200).
"""
import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "cuda")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--shapes", type=int, default=1, help="cycle through this many row counts (rows, rows + 1, ...)")
    ap.add_argument("--once", action="store_true", help="one run of --calls calls inside functools.reduce")
    args = ap.parse_args()
    import torch

    import lmmetrics
    from lmmetrics._engine import cuda as _cuda, inputs as _inputs
    from lmmetrics._engine.cuda import layout as _layout, triton as _triton
    import test_triton

    launches = test_triton._stubbed_driver()  # (each launch recorded: cleared each call)
    if launches is None:
        return 2
    _inputs.is_cuda = lambda x: isinstance(x, torch.Tensor)
    _cuda._force_triton = True
    empty = torch.empty
    filled = {}

    def zeroed(*a, **k):  # (the pass's result buffer: "counted, nothing wrong", a copy of one made once)
        out = empty(*a, **k)
        if out.dtype == torch.float64 and out.dim() == 2:
            if out.shape not in filled:
                filled[out.shape] = torch.zeros(out.shape, dtype=out.dtype)
                filled[out.shape][_layout.RES_FLAGS] = _layout.F_COUNTED
            out = filled[out.shape].clone()
        return out

    torch.empty = zeroed
    zs = torch.randn(args.rows + args.shapes - 1, args.vocab).bfloat16()
    ts = torch.randint(0, args.vocab, (args.rows + args.shapes - 1,))
    inputs = [(zs[:args.rows + i], ts[:args.rows + i]) for i in range(args.shapes)]
    z, t = inputs[0]
    turn = [0]

    def call():
        launches.clear()
        zz, tt = inputs[turn[0] % args.shapes]
        turn[0] += 1
        return lmmetrics.cross_entropy(zz, tt)

    for _ in range(max(30, args.shapes)):  # (every shape launched once)
        call()
    if args.once:
        functools.reduce(lambda a, _: call(), range(args.calls), None)
        return 0

    def best(fn):
        b = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            b = min(b, (time.perf_counter() - t0) / args.calls)
        return b * 1e6

    direct = _triton._direct
    shapes = f" ({args.shapes} row counts in turn)" if args.shapes > 1 else ""
    print(f"{args.rows} x {args.vocab} bfloat16 cross_entropy{shapes}, host time a call (driver stubbed):")
    print(f"  cached launch       {best(call):7.1f} us")
    _triton._direct = False
    print(f"  Triton's launcher   {best(call):7.1f} us")
    _triton._direct = direct

    def deferred():
        launches.clear()
        return float(lmmetrics.cross_entropy(z, t, sync=False))

    print(f"  sync=False (+float) {best(deferred):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
