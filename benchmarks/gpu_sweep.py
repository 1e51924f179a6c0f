"""The Triton span kernel's layouts on a GPU: for each dtype and layout
(warps, 16-byte lane-rows a thread, tiles a span; a span is 16384 entries
in each), the time of the NLL, `evaluate`, `evaluate` with the rank and
with a reference (KL) over 8192 x 128256 logits, as a fraction of a
read-only pass over the same buffer (of both, for KL), and the values
against the default layout's (within 2e-6: the bits depend on the layout,
the values do not). Then the host's cost of a call: 8 x 128256 against
``F.cross_entropy(...).item()``, and with ``sync=False`` (no wait). Run on a machine with a CUDA GPU, torch and
triton, from the repository root with PYTHONPATH=src; ``--smoke`` runs the
code on tiny CPU tensors under TRITON_INTERPRET=1 (timings meaningless).
"""
import argparse
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.rows, args.vocab, args.repeat = 2, 700, 1
    import torch
    import torch.nn.functional as F

    import lmmetrics
    from lmmetrics import _engine
    from lmmetrics._engine import inputs as _inputs
    from lmmetrics._engine.cuda import triton as _triton
    from lmmetrics.cli.bench.cuda import read_pass

    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:  # CPU tensors take the CUDA path, there the interpreted kernel
        from lmmetrics._engine import cuda as _cuda

        _inputs.is_cuda = lambda x: isinstance(x, torch.Tensor)
        _cuda._force_triton = True

    def best(fn):
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = min(t, time.perf_counter() - t0)
        return t

    layouts = {"bfloat16": [(8, 2, 4), (8, 1, 8), (4, 2, 8), (4, 4, 4), (8, 4, 2), (16, 1, 4)],
               "float32": [(4, 4, 8), (8, 2, 8), (8, 4, 4), (4, 2, 16)]}
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU (interpreter)'}; torch {torch.__version__}")
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype, options in layouts.items():
        z = (torch.randn(args.rows, args.vocab, generator=g, device=dev) * 3).to(getattr(torch, dtype))
        r = (z.float() + torch.randn(args.rows, args.vocab, generator=g, device=dev) * 0.5).to(z.dtype)
        t = torch.randint(0, args.vocab, (args.rows,), generator=g, device=dev)
        read = best(lambda: read_pass(z))
        print(f"\n{dtype} {args.rows} x {args.vocab}: read-only pass {read * 1e3:.3f} ms")
        print("warps lane-rows tiles | NLL (of read) | evaluate / NLL | +rank / NLL | KL (of 2 reads) | max |diff|")
        default = _triton._LAYOUTS[dtype]
        base = None
        for lay in options:
            vec = default[0]
            _triton._LAYOUTS[dtype] = (vec,) + lay
            try:
                res = _engine.run(z, t, r, nll=True, entropy=True, argmax=True, kl=True, rank=True)
                nll = best(lambda: lmmetrics.cross_entropy(z, t))
                ev = best(lambda: _engine.run(z, t, nll=True, entropy=True, argmax=True))
                rk = best(lambda: _engine.run(z, t, nll=True, entropy=True, argmax=True, rank=True))
                kl = best(lambda: _engine.run(z, t, r, nll=True, entropy=True, argmax=True, kl=True, ref_nll=True))
            except Exception as e:  # a layout this GPU or triton refuses
                print(f"{lay}: failed: {e!r}"[:200])
                continue
            finally:
                _triton._LAYOUTS[dtype] = default
            if base is None:
                base = res
            diff = max(float(np.max(np.abs(getattr(res, k) - getattr(base, k)))) for k in ("nll", "entropy", "kl"))
            same = all(np.array_equal(getattr(res, k), getattr(base, k)) for k in ("argmax", "rank"))
            print(f"{lay[0]:5} {lay[1]:9} {lay[2]:5} | {nll * 1e3:7.3f} ms ({read / nll:.2f}) | {ev / nll:.2f}x | "
                  f"{rk / nll:.2f}x | {kl * 1e3:7.3f} ms ({2 * read / kl:.2f}) | {diff:.1e}"
                  f"{'' if same else ' argmax/rank DIFFER'}")
        few, ft = z[:8], t[:8]
        theirs = best(lambda: F.cross_entropy(few.float(), ft, reduction="sum").item())
        direct = _triton._direct
        for how in (True, False) if direct else (False,):  # past Triton's binder, and through it
            _triton._direct = how
            ours = best(lambda: lmmetrics.cross_entropy(few, ft))
            print(f"8 x {args.vocab} ({'cached launch' if how else 'triton launcher'}): lmmetrics cross_entropy "
                  f"{ours * 1e6:.0f} us, F.cross_entropy(...).item() {theirs * 1e6:.0f} us ({ours / theirs:.2f}x)")
        _triton._direct = direct
        calls = 200  # sync=False: the host's time a call, the device not waited for (its queue filling)
        t0 = time.perf_counter()
        for _ in range(calls):
            lmmetrics.cross_entropy(few, ft, sync=False)
        host = (time.perf_counter() - t0) / calls
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"8 x {args.vocab}: lmmetrics cross_entropy(sync=False) {host * 1e6:.0f} us of host time a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
