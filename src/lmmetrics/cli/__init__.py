"""The ``lmmetrics`` command: ``score`` and ``compare`` over saved logits,
``bench``, ``info`` and ``demo`` (the default)."""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional, Sequence, Tuple, TypeVar

import numpy as np
import numpy.typing as npt

from .. import _core
from .._engine.config import show_config
from .._engine import check_positive_int
from .errors import InputError
from .export import TokenWriter
from .export import check_path as check_token_path
from .files import FORMATS, dtype_name, load_array, load_named, named_array
from .._engine.inputs import as_table
from .plot import check_path as check_plot_path
from .plot import plot
from .._version import __version__
from ..comparison import comparison_from_tokens, token_values
from ..convert import LN2, bits_per_unit
from ..evaluation import Evaluator
from ..metrics import bits_per_byte, cross_entropy, perplexity, token_nll
from ..ranking import MAX_BINS, Calibration, _check_bins, calibration_of


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


def _rows(x: Any, name: str, vocab: Optional[int] = None) -> Any:
    """A logits array as (rows, V) without copying (numpy or torch)."""
    if len(x.shape) < 1 or x.shape[-1] < 1:
        raise InputError(f"{name} must be shaped (..., vocab), got {tuple(x.shape)}")
    if "float" not in dtype_name(x):
        raise InputError(f"{name} must hold float logits, got dtype {x.dtype}")
    if vocab is not None and x.shape[-1] != vocab:
        raise InputError(f"{name} has a vocabulary of {x.shape[-1]}, the logits {vocab}")
    return x.reshape(-1, x.shape[-1])


def _targets(t: Any, logits_shape: Sequence[int], name: str = "targets", *, shift: bool = False) -> Any:
    """The targets, checked against the logits' shape (not yet flattened)."""
    kind = dtype_name(t) if hasattr(t, "dtype") else ""
    if "int" not in kind:
        raise InputError(f"{name} must hold integers, got dtype {kind}")
    shape, rows = tuple(t.shape), tuple(logits_shape[:-1])
    if shape != rows:
        hint = ""
        if rows and shape == rows[:-1] + (rows[-1] - 1,):  # one position fewer: aligned targets
            hint = ("; these targets are already aligned (targets[..., t] is the token after position t): "
                    "drop --shift, and give the logits without their last position (--shift wants unshifted "
                    "labels, as many positions as the logits)" if shift else
                    "; with one position fewer they look aligned with logits[..., :-1, :]: give the logits "
                    "without their last position, or unshifted labels (as many positions as the logits) "
                    "with --shift")
        raise InputError(f"{name} shape {shape} does not match the logits rows "
                         f"{rows} (logits shape {tuple(logits_shape)}){hint}")
    return t


def _check_alignment(t: npt.NDArray[np.integer[Any]], ids: Optional[npt.NDArray[Any]], where: str,
                     args: argparse.Namespace) -> None:
    """Refuse targets that certainly do not fit --shift (or its absence),
    judged against the dump's ``input_ids`` (``ids``, of the targets'
    shape): with --shift, labels already aligned (``targets[..., t] ==
    input_ids[..., t + 1]`` at every counted position, the last position of
    each sequence ignored, and not also equal to ``input_ids``); without it,
    targets equal to ``input_ids`` at every position (unshifted labels: every
    token would predict itself). Anything less certain passes."""
    if ids is None or t.ndim < 1 or t.size == 0:
        return
    counted = (t >= 0) & (t != args.ignore_index)
    if not counted.any():
        return
    unshifted = bool(np.array_equal(t[counted], ids[counted]))
    if args.shift:
        inner = counted[..., :-1]
        aligned = (not counted[..., -1].any()
                   and bool(np.array_equal(t[..., :-1][inner], ids[..., 1:][inner])))
        if aligned and not unshifted:
            raise InputError(f"--shift: these targets are already aligned: at every counted position "
                             f"targets[..., t] equals input_ids[..., t + 1] of {where} and each sequence's last "
                             f"position is ignored (shifted labels); --shift would shift them once more: drop "
                             f"--shift, and give the logits without their last position")
    elif np.array_equal(t, ids):
        raise InputError(f"the targets equal input_ids of {where} at every position: these are unshifted labels "
                         f"(Hugging Face's), and scored without shifting every token would predict itself; "
                         f"add --shift")


# the names Hugging Face gives ids that are unshifted (a causal LM shifts its labels inside the loss)
_UNSHIFTED_NAMES = ("labels", "label_ids", "input_ids")


def _check_said(name: str, tpath: str, ids: Optional[npt.NDArray[Any]], where: str,
                args: argparse.Namespace) -> None:
    """Refuse, unless --shift or --no-shift says which they are, targets
    that come the Hugging Face way, where ids are unshifted: an array named
    labels, label_ids or input_ids, or targets with the dump's input_ids
    beside them. Scored as aligned, unshifted labels give a plausible,
    wrong number."""
    if args.shift_said or (name not in _UNSHIFTED_NAMES and ids is None):
        return
    what = (f"the array named {name!r} of {tpath}" if name in _UNSHIFTED_NAMES else
            f"the targets of {tpath}, with input_ids beside them in {where}")
    raise InputError(f"{what}: Hugging Face's labels and input_ids are unshifted (the model shifts them inside "
                     f"its loss), so say which these are: --shift if they are unshifted (position t of the logits "
                     f"is scored against targets[..., t + 1]), --no-shift if they are already aligned with the "
                     f"logits (targets[..., t] is the token after position t)")


def _input_ids(paths: Sequence[str], shape: Tuple[int, ...]) -> Tuple[Optional[npt.NDArray[Any]], str]:
    """The integer array named ``input_ids`` of the targets' shape, from the
    first of ``paths`` (the targets file, then the logits file) holding one,
    and that file's name; (None, "") where none does."""
    for p in dict.fromkeys(paths):
        a = named_array(p, "input_ids")
        if a is not None and "int" in dtype_name(a) and tuple(a.shape) == shape:
            return np.asarray(a), p
    return None, ""


def _load_targets(tpath: str, lpath: str, raw: Any, args: argparse.Namespace) -> npt.NDArray[np.integer[Any]]:
    """The targets of a logits file, checked (shape, --shift), flattened."""
    name, t = load_named(tpath, "targets", args.targets_key)
    t = np.asarray(_targets(t, tuple(raw.shape), shift=args.shift))
    ids, where = _input_ids((tpath, lpath), t.shape)
    _check_alignment(t, ids, where, args)
    _check_said(name, tpath, ids, where, args)
    return t.reshape(-1)


def _chunk_rows(vocab: int, itemsize: int, args: argparse.Namespace) -> int:
    """Rows of logits in about --chunk-mb."""
    return max(1, int(args.chunk_mb * 2**20) // (vocab * itemsize))


def _chunks(n_rows: int, vocab: int, itemsize: int, args: argparse.Namespace) -> Iterable[Tuple[int, int]]:
    """Row ranges of about --chunk-mb each, with a progress bar."""
    step = _chunk_rows(vocab, itemsize, args)
    return _progress([(a, min(n_rows, a + step)) for a in range(0, n_rows, step)], args)


_T = TypeVar("_T")


def _progress(items: List[_T], args: argparse.Namespace) -> Iterable[_T]:
    """The items, with a progress bar on stderr (when it is a terminal and
    not --quiet, with tqdm installed)."""
    if args.quiet or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    bar: Iterable[_T] = tqdm(items, desc=f"lmmetrics {args.command}", unit="chunk", file=sys.stderr)
    return bar


def _paths(spec: str, role: str) -> List[str]:
    """The files ``spec`` names, sorted: itself (a file), the files
    of a directory whose names end in a known format, or a glob's matches."""
    if os.path.isdir(spec):
        found = sorted(os.path.join(spec, n) for n in os.listdir(spec)
                       if not n.startswith(".") and os.path.splitext(n)[1].lower() in FORMATS)
        if not found:
            raise InputError(f"{spec}: the directory holds no {', '.join(FORMATS)} file ({role})")
        return found
    if not os.path.exists(spec) and any(c in spec for c in "*?["):
        found = sorted(glob.glob(spec, recursive=True))
        if not found:
            raise InputError(f"{spec}: the pattern matches no file ({role})")
        return found
    return [spec]


_ShardKey = Tuple[Tuple[int, Any], ...]


def _shard_keys(paths: Sequence[str]) -> List[_ShardKey]:
    """What tells apart the shards of one list: each path (less its
    format's suffix) without the prefix and suffix that all of them share,
    never cut inside a number, as text and numbers, the numbers compared as
    numbers (``part-5`` and ``part-005`` are shard 5). One file is shard ()."""
    def digit(c: str) -> bool:
        return len(c) == 1 and "0" <= c <= "9"

    stems = [os.path.splitext(p)[0] for p in paths]
    if len(stems) < 2:
        return [()] * len(stems)
    pre = os.path.commonprefix(stems)
    if digit(pre[-1:]) and any(digit(s[len(pre):len(pre) + 1]) for s in stems):
        pre = pre.rstrip("0123456789")  # the prefix ends inside a number: keep the whole number
    rests = [s[len(pre):] for s in stems]
    post = os.path.commonprefix([r[::-1] for r in rests])[::-1]
    if digit(post[:1]) and any(digit(r[len(r) - len(post) - 1:len(r) - len(post)]) for r in rests):
        post = post.lstrip("0123456789")  # the same at the other end
    return [tuple((0, int(part)) if digit(part[0]) else (1, part)
                  for part in re.split(r"([0-9]+)", r[:len(r) - len(post)]) if part) for r in rests]


def _shards(*specs: Tuple[str, str, str]) -> List[Tuple[str, ...]]:
    """(label, file / directory / glob, role) of each input -> the shards,
    a tuple of paths each, in the order of their shard keys: each file
    paired with the one of each other list whose name has the same key
    (``_shard_keys``); files that pair with none are an error naming them."""
    lists = [_paths(spec, role) for _, spec, role in specs]
    if all(len(x) == 1 for x in lists):
        return [tuple(x[0] for x in lists)]
    keyed: List[Dict[_ShardKey, str]] = []
    for (label, spec, _), paths in zip(specs, lists):
        by_key: Dict[_ShardKey, str] = {}
        for k, p in zip(_shard_keys(paths), paths):
            if k in by_key:
                raise InputError(f"{label} {spec}: {by_key[k]} and {p} name the same shard (numbers in the "
                                 f"names are compared as numbers: part-5 is part-005)")
            by_key[k] = p
        keyed.append(by_key)
    common = set(keyed[0]).intersection(*keyed[1:])
    lonely = [(label, spec, [p for k, p in d.items() if k not in common])
              for (label, spec, _), d in zip(specs, keyed)]
    if any(names for _, _, names in lonely):
        def listed(names: List[str]) -> str:
            return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

        counts = ", ".join(f"{label} {spec} {len(d)}" for (label, spec, _), d in zip(specs, keyed))
        what = "; ".join(f"{label}: {listed(names)}" for label, spec, names in lonely if names)
        raise InputError(f"the shards do not pair by name; each file is paired with the one whose name differs "
                         f"from its list's others in the same way (the shard index, numbers compared as numbers: "
                         f"part-5 is part-005), and these have no partner: {what} (files: {counts})")
    return [tuple(d[k] for d in keyed) for k in sorted(common)]


_Load = TypeVar("_Load", bound=Tuple[Any, ...])


def _opened(shards: List[Tuple[str, ...]], load: Callable[[Tuple[str, ...], Optional[int]], _Load]
            ) -> Iterable[_Load]:
    """Each shard's arrays, ``load(paths, vocab)`` (its first array the
    logits, whose vocabulary every later shard must have). With several
    shards every one is opened and checked before any is scored, and an
    error names the shard."""
    n = len(shards)

    def one(i: int, vocab: Optional[int]) -> _Load:
        try:
            return load(shards[i], vocab)
        except InputError as e:
            if n == 1:
                raise
            raise InputError(f"shard {i + 1} of {n} ({', '.join(shards[i])}): {e}") from None

    first = one(0, None)
    vocab = int(first[0].shape[-1])
    if n > 1:
        del first
        for i in range(1, n):
            one(i, vocab)
        first = one(0, vocab)
    yield first
    for i in range(1, n):
        yield one(i, vocab)


def _score(args: argparse.Namespace) -> int:
    specs = [("LOGITS", args.logits, "logits"), ("TARGETS", args.targets, "targets")]
    if args.reference is not None:
        specs.append(("--reference", args.reference, "reference logits"))
    shards = _shards(*specs)
    tb = load_array(args.token_bytes, "token_bytes") if args.token_bytes else None
    ev = Evaluator(token_bytes=tb, ignore_index=args.ignore_index, softcap=args.softcap,
                   shift=args.shift, num_threads=args.threads)
    out = _TokenOutputs(args)  # --per-token, --plot

    def load(paths: Tuple[str, ...], vocab: Optional[int]) -> Tuple[Any, Any, npt.NDArray[np.integer[Any]]]:
        return _load_shard(paths, vocab, args)

    try:
        for i, (raw, ref, t) in enumerate(_opened(shards, load)):
            if i == 0:
                ev.check_vocab(int(raw.shape[-1]))  # a vocab / token_bytes mismatch fails before any work
            out.shard(raw.shape, t)
            for zc, rc, tc in _pieces(raw, ref, t, 1 if ref is None else 2, args):
                out.rows(ev._update_rows(zc, tc, reference_logits=rc, **out.wanted))
        m = ev.compute()
        out.close(m)
    except BaseException:
        out.abort()
        raise
    print(_json(m.as_dict()) if args.json else _table(m.as_dict()))
    return 0


def _load_shard(paths: Tuple[str, ...], vocab: Optional[int], args: argparse.Namespace
                ) -> Tuple[Any, Any, npt.NDArray[np.integer[Any]]]:
    """(logits, reference logits or None, flattened targets) of a shard
    (logits, targets[, reference]), checked against each other."""
    lpath, tpath = paths[:2]
    raw = load_array(lpath, "logits", args.key)
    z = _rows(raw, lpath, vocab)
    ref = None
    if len(paths) > 2:
        rpath = paths[2]
        ref = load_array(rpath, "reference logits", args.reference_key)
        r = _rows(ref, rpath, z.shape[1])
        if r.shape[0] != z.shape[0]:
            raise InputError(f"{rpath} has {r.shape[0]} rows, {lpath} has {z.shape[0]}")
        if args.shift and tuple(ref.shape) != tuple(raw.shape):
            raise InputError(f"{rpath} is shaped {tuple(ref.shape)}, {lpath} "
                             f"{tuple(raw.shape)} (--shift needs the same shape)")
    return raw, ref, _load_targets(tpath, lpath, raw, args)


class _TokenOutputs:
    """score's per-token outputs: --per-token (a file of per-position values,
    written chunk by chunk) and --plot (per-position mean NLL, calibration)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .._engine.checks import check_ignore_index

        self.args = args
        self.ignore = check_ignore_index(args.ignore_index)
        self.writer: Optional[TokenWriter] = None
        self.wanted: Dict[str, bool] = {}
        # the file's columns, whatever the rows (none at all included)
        self.columns = [("sequence", np.int64), ("position", np.int64), ("target", np.int64), ("nll", np.float64),
                        ("rank", np.int64), ("entropy", np.float64)] + \
            ([("kl", np.float64)] if args.reference is not None else [])
        if args.per_token:
            check_token_path(args.per_token)
            self.wanted["rank"] = True
        if args.plot:
            check_plot_path(args.plot)
            self.wanted["top_logprob"] = True
        self.pos_nll = np.zeros(0)
        self.pos_count = np.zeros(0)
        self.calibration: Optional[Calibration] = None
        self.sequences = 0  # sequences of the shards before
        self.where: Tuple[npt.NDArray[np.int64], ...] = ()
        self.taken = 0

    def shard(self, shape: Tuple[int, ...], t: npt.NDArray[np.integer[Any]]) -> None:
        """A shard's counted positions, in the order its pieces give them:
        (sequence, position in the sequence, target)."""
        if not self.wanted:
            return
        lead = tuple(int(n) for n in shape[:-1])
        steps = lead[-1] if lead else 1
        t2 = np.asarray(t).reshape(math.prod(lead[:-1]), steps)  # (0, V) is one sequence of no position
        first = 1 if self.args.shift else 0  # with --shift, position t predicts targets[t + 1]
        aligned = t2[:, first:]
        idx = np.flatnonzero((aligned >= 0) & (aligned != self.ignore))
        width = max(1, aligned.shape[1])
        seq, pos = idx // width, idx % width + first
        self.where = (seq + self.sequences, pos, aligned.reshape(-1)[idx].astype(np.int64))
        self.sequences += t2.shape[0]
        self.taken = 0

    def rows(self, res: Any) -> None:
        """A piece's per-row results."""
        if not self.wanted:
            return
        c = res.counted
        n = int(np.count_nonzero(c))
        seq, pos, tgt = (a[self.taken:self.taken + n] for a in self.where)
        self.taken += n
        nll = res.floats("nll")[c]
        if self.args.plot:
            size = int(pos.max()) + 1 if n else 0
            if size > self.pos_nll.size:
                self.pos_nll = np.pad(self.pos_nll, (0, size - self.pos_nll.size))
                self.pos_count = np.pad(self.pos_count, (0, size - self.pos_count.size))
            self.pos_nll[:size] += np.bincount(pos, weights=nll, minlength=size)
            self.pos_count[:size] += np.bincount(pos, minlength=size)
            part = calibration_of(res, self.args.bins)
            self.calibration = part if self.calibration is None else self.calibration.add(part)
        if self.args.per_token:
            cols: Dict[str, npt.NDArray[Any]] = {"sequence": seq, "position": pos, "target": tgt, "nll": nll,
                                                 "rank": res.indices("rank")[c], "entropy": res.floats("entropy")[c]}
            if res.kl is not None:
                cols["kl"] = res.floats("kl")[c]
            self._writer().write(cols)

    def _writer(self) -> TokenWriter:
        if self.writer is None:
            self.writer = TokenWriter(self.args.per_token, self.columns)
        return self.writer

    def close(self, m: Any) -> None:
        if self.args.per_token:
            self._writer().close()  # with no row at all: the columns, empty
        if self.args.plot:
            plot(self.args.plot, self.pos_nll, self.pos_count, self.calibration,
                 title=f"{m.tokens} tokens, loss {m.loss:.4f} nats" if m.tokens else "no counted token")

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


# score's table: each field of Metrics with its unit (fractions as %)
_UNITS = {"nll_sum": "nats", "loss": "nats per token", "bits_per_token": "bits",
          "bits_per_byte": "bits", "accuracy": "%", "entropy": "nats per token", "kl": "nats per token",
          "same_top": "%", "loss_ref": "nats per token", "loss_diff": "nats per token"}


def _table(d: Dict[str, Any]) -> str:
    """One line a value with its unit: a mean with its standard error
    (``± se``; ``(documents ± se)`` clustered by document), the perplexity
    with its 95% interval."""
    def num(v: Any, unit: str, digits: int = 6) -> str:
        return str(v) if isinstance(v, int) else f"{100 * v if unit == '%' else v:.{digits}g}"

    shown = [(k, v) for k, v in d.items() if v is not None and not k.endswith(("_stderr", "_stderr_documents"))
             and not k.startswith(("perplexity_low", "perplexity_high"))]
    rows = []
    width = max(16, max(len(k) for k, _ in shown) + 2)
    for k, v in shown:
        unit = _UNITS.get(k[len("macro_"):] if k.startswith("macro_") else k, "")
        text = num(v, unit)
        if d.get(k + "_stderr") is not None:
            text += f" ± {num(d[k + '_stderr'], unit, 2)}"
        if d.get(k + "_stderr_documents") is not None:
            text += f" (documents ± {num(d[k + '_stderr_documents'], unit, 2)})"
        for tag in ("", "_documents"):
            if k == "perplexity" and d.get("perplexity_low" + tag) is not None:
                text += (f" (95%{' documents' if tag else ''}: {num(d['perplexity_low' + tag], '')}"
                         f" to {num(d['perplexity_high' + tag], '')})")
        rows.append(f"{k:<{width}}{text}{' ' + unit if unit else ''}")
    return "\n".join(rows)


def _json(d: Dict[str, Any]) -> str:
    """Strict JSON (RFC 8259): a NaN or infinite value (no counted token,
    no byte, too few tokens for an uncertainty) is written as null."""
    def finite(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, float) and not math.isfinite(x):
            return None
        return x
    return json.dumps(finite(d), allow_nan=False)


def _pieces(raw: Any, ref: Any, t: npt.NDArray[np.integer[Any]], buffers: int,
            args: argparse.Namespace) -> Iterable[Tuple[Any, Any, npt.NDArray[np.integer[Any]]]]:
    """(logits, reference, targets) chunks of about --chunk-mb of logits
    (``buffers`` logits arrays read together), views of the inputs.

    Without --shift the logits are rows (N, V) and the targets (N,). With
    --shift the sequence axis (the second-to-last) is kept: whole sequences
    (k, T, V) at a time, or, when one sequence is over the chunk size, its
    positions [a, e] (scoring a..e-1 against the targets a+1..e), each piece
    for the library's ``shift=True``, which drops its last position."""
    vocab = int(raw.shape[-1])
    itemsize = buffers * _itemsize(raw)
    if not args.shift:
        z = raw.reshape(-1, vocab)
        r = None if ref is None else ref.reshape(-1, vocab)
        tf = t.reshape(-1)
        for a, b in _chunks(z.shape[0], vocab, itemsize, args):
            yield z[a:b], None if r is None else r[a:b], tf[a:b]
        return
    if len(raw.shape) < 2:
        raise InputError(f"--shift needs logits shaped (..., T, V), got {tuple(raw.shape)}")
    steps = int(raw.shape[-2])
    seqs = math.prod(int(n) for n in raw.shape[:-2])  # explicit: -1 is ambiguous for (B, 0, V)
    z3 = raw.reshape(seqs, steps, vocab)
    r3 = None if ref is None else ref.reshape(seqs, steps, vocab)
    t2 = t.reshape(seqs, steps)
    per_seq = max(1, steps)
    rows = _chunk_rows(vocab, itemsize, args)
    pieces: List[Tuple[int, int, int, int]] = []  # (first seq, end seq, first pos, end pos)
    if rows >= per_seq or steps < 2:
        k = max(1, rows // per_seq)
        pieces = [(s0, min(seqs, s0 + k), 0, steps) for s0 in range(0, seqs, k)]
    else:
        step = max(1, rows - 1)  # positions scored per piece; one more is read
        pieces = [(s0, s0 + 1, a, min(steps, a + step + 1))
                  for s0 in range(seqs) for a in range(0, steps - 1, step)]
    for s0, s1, a, e in _progress(pieces, args):
        yield (z3[s0:s1, a:e], None if r3 is None else r3[s0:s1, a:e], t2[s0:s1, a:e])


def _compare(args: argparse.Namespace) -> int:
    if args.extra or args.reference is None:
        given = " ".join([args.logits, args.targets, *args.extra])
        raise InputError(f"compare takes LOGITS TARGETS --reference REFERENCE_LOGITS (got {given!r}"
                         f"{'' if args.reference is None else ' --reference ' + args.reference}); the old form "
                         f"REFERENCE LOGITS TARGETS is refused so that a swapped order cannot pass unnoticed; several "
                         f"files go as a directory or a quoted glob ('shards/*.npy')")
    if args.format == "llama.cpp" and (args.json or args.token_bytes or args.top_k):
        option = "--json" if args.json else "--token-bytes" if args.token_bytes else "--top-k"
        raise InputError(f"--format llama.cpp prints llama.cpp's table alone; {option} needs --format table")
    shards = _shards(("LOGITS", args.logits, "logits"), ("TARGETS", args.targets, "targets"),
                     ("--reference", args.reference, "reference logits"))

    def load(paths: Tuple[str, ...], vocab: Optional[int]) -> Tuple[Any, Any, npt.NDArray[np.integer[Any]]]:
        return _load_shard(paths, vocab, args)

    table = None
    parts = []
    counted_ids = []
    for i, (raw, ref, t) in enumerate(_opened(shards, load)):
        if i == 0 and args.token_bytes:
            table = as_table(load_array(args.token_bytes, "token_bytes"), int(raw.shape[-1]), "token_bytes")
        for zc, rc, tc in _pieces(raw, ref, t, 2, args):
            parts.append(token_values(rc, zc, tc, ignore_index=args.ignore_index, shift=args.shift,
                                      softcap=args.softcap, num_threads=args.threads, top_k=args.top_k))
            if table is not None:
                ids = np.asarray(tc)[..., 1:] if args.shift else np.asarray(tc)
                ids = ids.reshape(-1)
                keep = ids >= 0 if args.ignore_index is None else (ids >= 0) & (ids != args.ignore_index)
                counted_ids.append(ids[keep])
    if not parts:
        raise InputError(f"no counted token to compare: {args.logits} holds no positions")
    values = [np.concatenate([p[i] for p in parts]) for i in range(4)]
    in_top_k = None if args.top_k is None else np.concatenate([p[4] for p in parts if p[4] is not None])
    cmp = comparison_from_tokens(values[0], values[1], values[2], values[3], in_top_k=in_top_k, top_k=args.top_k)
    bpb: Optional[Tuple[float, float]] = None
    if table is not None:
        nbytes = table[np.concatenate(counted_ids)]
        has = nbytes > 0
        total = float(np.sum(nbytes))
        bpb = (bits_per_unit(math.fsum(values[0][has]), total), bits_per_unit(math.fsum(values[1][has]), total))
    if args.json:
        d = cmp.as_dict()
        if bpb is not None:
            d["bits_per_byte"], d["bits_per_byte_ref"] = bpb
        print(_json(d))
    elif args.format == "llama.cpp":
        print(cmp.llama_cpp())
    else:
        print(cmp)
        if bpb is not None:
            print(f"bits per byte (model / reference): {bpb[0]:.6f} / {bpb[1]:.6f} bits")
    return 0


def _itemsize(x: Any) -> int:
    return int(x.element_size() if hasattr(x, "element_size") else x.itemsize)


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
the dump's input_ids are refused (every token would predict itself).

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
                                             "file (default: its only array, or the one named targets or labels)")
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
                       help="logits read per step, in MiB (default 256)")
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
    s.add_argument("--reference-key", help="the array to read from the reference file (default as --key's)")
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
    c.add_argument("--reference-key", help="the array to read from the reference file (default as --key's)")
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
