"""The ``lmmetrics`` command: ``score`` and ``compare`` over saved logits
(`score.py`, `compare.py`), ``bench``, ``info`` and ``demo`` (the default);
the parser and `main`."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence

import numpy as np

from .. import _core
from .._engine import check_positive_int
from .._engine.config import show_config
from .._version import __version__
from ..convert import LN2
from ..metrics import bits_per_byte, cross_entropy, perplexity, token_nll
from ..ranking import MAX_BINS, _check_bins
from .compare import _compare
from .errors import InputError
from .score import _score


def _demo(_args: argparse.Namespace) -> int:
    """Metrics of a small built-in example: 3 positions over a 4-token vocabulary."""
    logits = np.array([[2.0, 1.0, -1.0, -2.0], [-1.0, 2.0, 1.0, -2.0], [1.0, -1.0, 2.0, -2.0]], np.float32)
    targets = np.array([1, 2, 2])
    token_bytes = np.array([1, 1, 2, 0])
    print("example: 3 positions, vocabulary of 4, targets", targets.tolist())
    print(f"  token NLL (nats)  {[round(float(x), 6) for x in token_nll(logits, targets)]}")
    print(f"  cross-entropy     {cross_entropy(logits, targets):.6f} nats")
    print(f"  perplexity        {perplexity(logits, targets):.6f}")
    print(f"  bits per token    {cross_entropy(logits, targets) / LN2:.6f}")
    print(f"  bits per byte     {bits_per_byte(logits, targets, token_bytes):.6f}  (token_bytes {token_bytes.tolist()})")
    print()
    show_config()
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.lazy:
        if args.compile:
            raise InputError("--lazy takes no --compile")
        if args.device == "cpu" and args.dtype == "float16":
            raise InputError("--lazy times the CPU (torch) matmul in float32, bfloat16 or float64 "
                             "(float16 with --device cuda)")
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise InputError("--lazy needs torch (pip install torch)")
        from .bench.lazy import bench_lazy, bench_lazy_device

        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise InputError("--device cuda, but torch sees no CUDA device")
            return bench_lazy_device("cuda", args.tokens, args.hidden, args.vocab, args.dtype or "bfloat16",
                                     args.repeat)
        return bench_lazy(args.tokens, args.hidden, args.vocab, args.dtype or "float32",
                          args.threads or _core.max_threads(), min(args.repeat, 3))
    if args.device == "cuda":
        from .bench.cuda import DTYPES, bench_cuda

        return bench_cuda(args.tokens, args.vocab, DTYPES if args.dtype is None else (args.dtype,), args.repeat)
    from .bench.cpu import DTYPES as CPU_DTYPES, bench_cpu

    return bench_cpu(args.tokens, args.vocab, CPU_DTYPES if args.dtype is None else (args.dtype,),
                     args.threads or _core.max_threads(), args.repeat, compile=args.compile)


def _info(_args: argparse.Namespace) -> int:
    show_config()
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the error as one line (``lmmetrics score: error: ...``),
    exit code 2, like every other bad input."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):  # most often a glob the shell expanded
            message += "; several files go to score and compare as a directory or a quoted glob ('shards/*.npy')"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    try:
        return check_positive_int("value", v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None


def _bins(text: str) -> int:
    v = _positive_int(text)
    try:
        return _check_bins(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _vocab(text: str) -> int:
    v = _positive_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (one token is certain: its loss is 0), got {text!r}")
    return v


_MAX_CHUNK_MB = 2.0 ** 20  # 1 TiB


def _chunk_mb(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not 0 < v <= _MAX_CHUNK_MB:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {_MAX_CHUNK_MB:.0f} (1 TiB), got {text!r}")
    return v


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``lmmetrics | head -1``): stop quietly,
    as Unix tools do, with the status of a process ended by SIGPIPE. stdout
    goes to devnull so that the interpreter's last flush cannot fail too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


_MAIN_EPILOG = """\
examples:
  lmmetrics                                        metrics of a built-in example, and the build
  lmmetrics score logits.npy targets.npy           every metric of saved logits
  lmmetrics compare quant.npy targets.npy --reference base.npy
                                                   a model against its reference (llama.cpp's KLD)
  lmmetrics bench                                  time the kernel on this machine
  lmmetrics COMMAND --help                         the options of a command
"""


_SCORE_EPILOG = """\
examples:
  lmmetrics score logits.npy targets.npy --token-bytes token_bytes.npy
  lmmetrics score dump.safetensors targets.pt --key logits --json
  lmmetrics score dump.pt dump.pt --shift          a Hugging Face dump of {logits, labels}, labels unshifted
  lmmetrics score logits/ targets/                 shards: the files of each directory, paired by name
  lmmetrics score 'run/logits-*.npy' 'run/targets-*.npy'     a glob each (quoted: lmmetrics expands it)
  lmmetrics score dumps/ dumps/ --shift            shards of {logits, labels} dumps
  lmmetrics score q.npy t.npy --reference base.npy --per-token tokens.npz --plot run.png

LOGITS and TARGETS are each a file, a directory (its .npy / .npz /
.safetensors / .pt / .pth files) or a glob; their files are paired by the
part of the name that tells a list's files apart (part-5 with part-005,
logits-3 with targets-3; a file that pairs with none is an error) and
scored, in the order of those numbers, through one Evaluator, every shard
checked before any is scored. Targets named labels, label_ids or input_ids,
or with input_ids beside them, are Hugging Face's, unshifted: say --shift,
or --no-shift if they are aligned already. --shift refuses targets that are
certainly aligned already (one position fewer than the logits, or labels
equal to the dump's input_ids shifted by one); without it, targets equal to
the dump's input_ids wherever counted are refused (every token would
predict itself).

table: loss and entropy in nats per token, bits per token / byte in bits,
accuracy in %; each mean with its standard error (±), the perplexity with
its 95% interval. --json: one line of strict JSON, the same fields
(<mean>_stderr, perplexity_low / perplexity_high), fractions (accuracy,
same_top) as fractions, null for NaN / inf or a metric that does not apply
(bits_per_byte without --token-bytes).
--per-token FILE (.npz, .parquet with pyarrow): one row per counted position
(sequence, position, target, nll, rank, entropy, kl with --reference),
written chunk by chunk into a temporary file renamed when complete.
--plot FILE.png (matplotlib): mean NLL by position and the calibration
curve.
"""


_COMPARE_EPILOG = """\
examples:
  lmmetrics compare quant.npy targets.npy --reference base.npy
  lmmetrics compare q.safetensors labels.pt --reference base.pt --reference-key logits --shift
  lmmetrics compare quant.npy targets.npy --reference base.npy --format llama.cpp
  lmmetrics compare quant/ targets/ --reference base/       shards, paired by name

LOGITS, TARGETS and --reference are each a file, a directory or a glob, as
for score.

table: KLD and ln(PPL(Q)/PPL(base)) in nats, Δp, RMS Δp and same top p in %.
--format llama.cpp prints llama-perplexity --kl-divergence's statistics byte for
byte (no units, no token count). --json: one line of strict JSON, probabilities
(delta_p, rms_delta_p, same_top) as fractions, percentile keys as "99.9%",
null for NaN / inf.
"""


_BENCH_EPILOG = """\
examples:
  lmmetrics bench                                  Llama 3 sized: 2048 x 128256, every dtype
  lmmetrics bench --dtype bfloat16 --threads 8
  lmmetrics bench --device cuda                    needs torch and triton, and a GPU
  lmmetrics bench --lazy --tokens 1024             metrics from hidden states and a head (d 2048)
                                                   against the logits materialized: time, peak memory
  lmmetrics bench --lazy --device cuda --tokens 8192   the same on a GPU (bfloat16)
"""


_REFERENCE_KEY_HELP = ("the array to read from the reference file (default: the one --key names, where "
                       "the reference file holds it; else as for the logits: its only array, the one "
                       "named logits, or its only float array)")


def _subparser(sub: Any, name: str, help: str, description: str, epilog: Optional[str] = None,
               parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description, epilog=epilog,
                                                parents=list(parents),
                                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return p


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lmmetrics", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Language-model metrics from logits: NLL, perplexity, bits per token and "
                                 "per byte, accuracy,\nentropy, and a model against its reference (KL "
                                 "divergence). Without a command: the demo.",
                     epilog=_MAIN_EPILOG)
    parser.add_argument("--version", action="version", version=f"lmmetrics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _subparser(sub, "demo", "metrics of a small built-in example, and the build config (default)",
               "Every metric of a 3-position example over a 4-token vocabulary, then the build and "
               "run-time configuration.")
    _subparser(sub, "info", "the build and run-time configuration",
               "The build (compiler flags, OpenMP), the SIMD paths and the thread count.")
    files = _Parser(add_help=False)
    files.add_argument("--key", help="the array to read from an .npz / .safetensors / .pt logits file "
                                     "(default: its only array, the one named logits, or its only float array)")
    files.add_argument("--targets-key", help="the array to read from an .npz / .safetensors / .pt targets "
                                             "file (default: its only array, or the one named targets or labels; "
                                             "a file holding both needs this option)")
    files.add_argument("--ignore-index", type=int, default=-100,
                       help="targets equal to this (and negative ones) are ignored (default -100)")
    files.add_argument("--json", action="store_true",
                       help="print one line of strict JSON instead of a table (null where a value is NaN or "
                            "infinite: no counted token, no byte, too few tokens for an uncertainty)")
    files.add_argument("--quiet", action="store_true", help="no progress bar")
    files.add_argument("--threads", type=_positive_int, default=None,
                       help="threads (default: the OpenMP default)")
    side = files.add_mutually_exclusive_group()
    side.add_argument("--shift", action="store_const", const=True, default=None,
                      help="unshifted (Hugging Face) targets: position t of the logits is scored against "
                           "targets[..., t + 1], the last position of each sequence dropped")
    side.add_argument("--no-shift", dest="shift", action="store_const", const=False,
                      help="targets aligned with the logits (the default), said: needed for targets named "
                           "labels, label_ids or input_ids, or with input_ids beside them, which Hugging Face "
                           "gives unshifted")
    files.add_argument("--chunk-mb", type=_chunk_mb, default=256.0,
                       help="logits read per step (with the reference's), in MiB (default 256)")
    files.add_argument("--token-bytes", help="file with the byte length of each token id (for bits per byte)")
    files.add_argument("--softcap", type=float, default=None, help="apply c * tanh(z / c) to the logits (both, for compare) first")
    s = _subparser(sub, "score", "every metric of saved logits and targets",
                   "Every metric of LOGITS (..., V) against TARGETS (...), from .npy (memory-mapped), "
                   ".npz,\n.safetensors (memory-mapped) or .pt files, read in chunks of --chunk-mb.",
                   _SCORE_EPILOG, [files])
    s.add_argument("logits", metavar="LOGITS", help="a file, a directory of shards or a glob")
    s.add_argument("targets", metavar="TARGETS", help="a file, a directory or a glob (as many files as LOGITS)")
    s.add_argument("--reference", metavar="REFERENCE_LOGITS",
                   help="a reference model's logits (file, directory or glob), the same shape as LOGITS: adds "
                        "kl, same_top, loss_ref and the paired loss_diff")
    s.add_argument("--reference-key", help=_REFERENCE_KEY_HELP)
    s.add_argument("--per-token", metavar="FILE",
                   help="write each counted position's values to FILE (.npz, or .parquet with pyarrow), chunk by "
                        "chunk: sequence, position, target, nll, rank, entropy (kl with --reference)")
    s.add_argument("--plot", metavar="FILE",
                   help="draw the mean NLL by position and the calibration curve into FILE (.png; needs "
                        "matplotlib)")
    s.add_argument("--bins", type=_bins, default=15,
                   help=f"--plot: calibration bins over [0, 1] (default 15, at most {MAX_BINS:,})")
    c = _subparser(sub, "compare", "a model's logits against a reference model's (llama.cpp's KLD statistics)",
                   "The statistics of llama-perplexity --kl-divergence for a model's LOGITS against a "
                   "reference\n(base) model's, on the same TARGETS: perplexities and their ratio, KL "
                   "divergence and Δp\npercentiles, top-token agreement. Both logits are read once, "
                   "together.", _COMPARE_EPILOG, [files])
    c.add_argument("logits", metavar="LOGITS", help="a file, a directory of shards or a glob")
    c.add_argument("targets", metavar="TARGETS", help="a file, a directory or a glob (as many files as LOGITS)")
    c.add_argument("extra", nargs="*", help=argparse.SUPPRESS)  # the old REFERENCE LOGITS TARGETS form
    c.add_argument("--reference", metavar="REFERENCE_LOGITS",
                   help="the reference (base) model's logits, the same shape as LOGITS: a file, a "
                        "directory or a glob (required)")
    c.add_argument("--reference-key", help=_REFERENCE_KEY_HELP)
    c.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                   help="add the share of tokens whose reference top-1 is in the model's top K (reads the "
                        "logits a second time)")
    c.add_argument("--format", choices=["table", "llama.cpp"], default="table",
                   help="table: with units and the token count (default); llama.cpp: llama-perplexity's "
                        "statistics byte for byte")
    b = _subparser(sub, "bench", "time the fused kernel on a synthetic Llama-3-sized workload",
                   "Time the kernel on synthetic logits against a read-only pass over the same memory (and "
                   "torch's\nF.cross_entropy when installed), after checking the summed NLL against float64.",
                   _BENCH_EPILOG)
    b.add_argument("--tokens", type=_positive_int, default=2048, help="rows of logits (default 2048)")
    b.add_argument("--vocab", type=_vocab, default=128256, help="vocabulary size, at least 2 (default 128256)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default=None,
                   help="logits dtype (default: each)")
    b.add_argument("--threads", type=_positive_int, default=None, help="threads (default: the OpenMP default)")
    b.add_argument("--repeat", type=_positive_int, default=5, help="timed repetitions, best kept (default 5)")
    b.add_argument("--compile", action="store_true",
                   help="add a torch.compile column (CPU; compiles once per dtype, tens of seconds each)")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the native kernel (default); cuda: the CUDA path (Triton, needs torch "
                        "and triton) against a read-only pass and F.cross_entropy")
    b.add_argument("--lazy", action="store_true",
                   help="lmmetrics.projected(hidden, head) against the matmul alone and the logits "
                        "materialized + F.cross_entropy: seconds and peak memory (needs torch; CPU: "
                        "float32 by default, each variant in its own process, --repeat at most 3; "
                        "--device cuda: bfloat16 by default, peak GPU memory)")
    b.add_argument("--hidden", type=_positive_int, default=2048,
                   help="--lazy: the hidden size (default 2048)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("score", "compare"):  # --shift, --no-shift or neither
        args.shift_said, args.shift = args.shift is not None, bool(args.shift)
    handlers: Dict[Optional[str], Callable[[argparse.Namespace], int]] = {"score": _score, "compare": _compare, "bench": _bench, "info": _info, "demo": _demo,
                None: _demo}
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except (InputError, ValueError, TypeError, OSError, MemoryError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, MemoryError):
            msg = f"out of memory{': ' + msg if msg != 'MemoryError' else ''}"
        elif isinstance(e, OSError):
            msg = f"{e.filename + ': ' if e.filename else ''}{e.strerror or msg}"
        print(f"lmmetrics {args.command or 'demo'}: error: {msg}", file=sys.stderr)
        return 2
