"""What `score` and `compare` share: saved arrays found and paired as shards, read
and checked, cut into chunks of rows, and the JSON output."""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
import numpy.typing as npt

from .._engine.errors import RowError, TargetError, row_error
from .errors import InputError
from .files import FORMATS, array_names, dtype_name, load_array, load_named, named_array


# the logits' dtypes the kernels take (checked with the shard, before any is scored, the file named)
_LOGIT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _rows(x: Any, name: str, vocab: Optional[int] = None) -> Any:
    """A logits array as (rows, V) without copying (numpy or torch)."""
    if len(x.shape) < 1 or x.shape[-1] < 1:
        raise InputError(f"{name} must be shaped (..., vocab), got {tuple(x.shape)}")
    kind = dtype_name(x).replace("torch.", "")
    if kind not in _LOGIT_DTYPES:
        raw = (" (2-byte raw data: numpy saves an ml_dtypes bfloat16 array so, its type lost; save it as "
               ".safetensors or .pt)" if kind == "void16" else "")
        raise InputError(f"{name} must hold float logits ({', '.join(_LOGIT_DTYPES)}), got dtype {x.dtype}{raw}")
    if vocab is not None and x.shape[-1] != vocab:
        raise InputError(f"{name} has a vocabulary of {x.shape[-1]}, the logits {vocab}")
    return x.reshape(-1, x.shape[-1])


def _targets(t: Any, logits_shape: Sequence[int], name: str = "targets", *, shift: bool = False) -> Any:
    """The targets, checked against the logits' shape (not yet flattened)."""
    kind = dtype_name(t) if hasattr(t, "dtype") else ""
    if "int" not in kind:
        raise InputError(f"{name} must hold integers, got dtype {kind}")
    shape, rows = tuple(t.shape), tuple(logits_shape[:-1])
    if shift and len(logits_shape) < 2:  # (checked with the shard, before any is scored)
        raise InputError(f"--shift needs logits shaped (..., T, V), got {tuple(logits_shape)}")
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
    targets equal to ``input_ids`` at every counted position (unshifted
    labels, padded or with a masked prompt: every token would predict
    itself), and not also equal to ``input_ids[..., t + 1]`` at every counted
    position that has one (a run of one repeated token is both, and so are
    aligned targets counted at each sequence's last position only, whose
    next token the dump does not hold). Anything less certain passes."""
    if ids is None or t.ndim < 1 or t.size == 0:
        return
    counted = (t >= 0) & (t != args.ignore_index)
    if not counted.any():
        return
    unshifted = bool(np.array_equal(t[counted], ids[counted]))
    inner = counted[..., :-1]
    fits_next = bool(np.array_equal(t[..., :-1][inner], ids[..., 1:][inner]))
    aligned = fits_next and not counted[..., -1].any()
    if args.shift:
        if aligned and not unshifted:
            raise InputError(f"--shift: these targets are already aligned: at every counted position "
                             f"targets[..., t] equals input_ids[..., t + 1] of {where} and each sequence's last "
                             f"position is ignored (shifted labels); --shift would shift them once more: drop "
                             f"--shift, and give the logits without their last position")
    elif unshifted and not fits_next:
        raise InputError(f"the targets equal input_ids of {where} at every counted position: these are unshifted "
                         f"labels (Hugging Face's), and scored without shifting every token would predict itself; "
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
            raise InputError(f"{_shard_name(shards, i)}{e}") from None

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


def _shard_name(shards: List[Tuple[str, ...]], i: int) -> str:
    """How an error names shard i: "" when it is the only one."""
    return "" if len(shards) == 1 else f"shard {i + 1} of {len(shards)} ({', '.join(shards[i])}): "


#: a piece's map from a row of its pass (flattened) to the shard's flat
#: position, for the logits (False) or the targets (True)
_At = Callable[[int, bool], int]


@contextlib.contextmanager
def _named(where: str, lead: Tuple[int, ...], at: _At) -> Iterator[None]:
    """A piece's pass: a bad row or target is named at its position in the
    shard (leading shape ``lead``; ``at``, `_pieces`), after ``where``
    (`_shard_name`), not at its row in the piece."""
    try:
        yield
    except RowError as e:
        raise InputError(f"{where}{row_error(e.status, at(e.row, False), lead)}") from None
    except TargetError as e:  # (shifted: the pass read the targets one position on)
        raise InputError(f"{where}{TargetError(e.value, at(e.row, e.shifted), e.n_cols, lead)}") from None


def _load_shard(paths: Tuple[str, ...], vocab: Optional[int], args: argparse.Namespace
                ) -> Tuple[Any, Any, npt.NDArray[np.integer[Any]]]:
    """(logits, reference logits or None, flattened targets) of a shard
    (logits, targets[, reference]), checked against each other."""
    lpath, tpath = paths[:2]
    name, raw = load_named(lpath, "logits", args.key)
    z = _rows(raw, lpath, vocab)
    ref = None
    if len(paths) > 2:
        rpath = paths[2]
        names = array_names(rpath) if args.reference_key is None and os.path.samefile(lpath, rpath) else []
        if len(names) > 1:
            # (the reference's default rules are the logits': the same array, compared with itself)
            raise InputError(f"--reference {rpath} is the logits' file, which holds several arrays "
                             f"{names}: name the reference's with --reference-key (without it the "
                             f"reference would be the logits' own array {name!r}, compared with itself)")
        # (without --reference-key, the array --key names where the reference file holds one: the
        # reference file's "logits" beside it would be another array, compared unseen)
        ref = load_array(rpath, "reference logits", args.reference_key, prefer=args.key)
        _rows(ref, rpath, z.shape[1])
        if tuple(ref.shape) != tuple(raw.shape):  # (rows of other layouts would pair up unseen)
            raise InputError(f"{rpath} is shaped {tuple(ref.shape)}, {lpath} {tuple(raw.shape)}: the reference "
                             f"logits must have the logits' shape")
    return raw, ref, _load_targets(tpath, lpath, raw, args)


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


def _pieces(raw: Any, ref: Any, t: npt.NDArray[np.integer[Any]],
            args: argparse.Namespace) -> Iterable[Tuple[Any, Any, npt.NDArray[np.integer[Any]], _At]]:
    """(logits, reference, targets, at) chunks of about --chunk-mb of logits
    (the logits' and the reference's bytes together, each of its own dtype),
    views of the inputs; ``at``
    maps a row of the piece's pass to its flat position in the shard
    (`_named`).

    Without --shift the logits are rows (N, V) and the targets (N,). With
    --shift the sequence axis (the second-to-last) is kept: whole sequences
    (k, T, V) at a time, or, when one sequence is over the chunk size, its
    positions [a, e] (scoring a..e-1 against the targets a+1..e), each piece
    for the library's ``shift=True``, which drops its last position."""
    vocab = int(raw.shape[-1])
    itemsize = _itemsize(raw) + (0 if ref is None else _itemsize(ref))
    if not args.shift:
        z = raw.reshape(-1, vocab)
        r = None if ref is None else ref.reshape(-1, vocab)
        tf = t.reshape(-1)
        for a, b in _chunks(z.shape[0], vocab, itemsize, args):
            def after(row: int, target: bool, a: int = a) -> int:
                return a + row

            yield z[a:b], None if r is None else r[a:b], tf[a:b], after
        return
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
        def at(row: int, target: bool, s0: int = s0, a: int = a, e: int = e) -> int:
            s, p = divmod(row, max(1, e - a - 1))  # (the pass scores e - a - 1 positions a sequence)
            return (s0 + s) * steps + a + p + int(target)

        yield (z3[s0:s1, a:e], None if r3 is None else r3[s0:s1, a:e], t2[s0:s1, a:e], at)


def _itemsize(x: Any) -> int:
    return int(x.element_size() if hasattr(x, "element_size") else x.itemsize)
