"""`lmmetrics compare`: a model's saved logits against a reference's (llama.cpp's
KL-divergence statistics)."""
from __future__ import annotations

import argparse
import math
from typing import Any, Optional, Tuple

import numpy as np
import numpy.typing as npt

from .._engine.inputs import as_table
from ..comparison import comparison_from_tokens, token_values
from ..convert import bits_per_unit
from .common import _json, _load_shard, _named, _opened, _pieces, _shard_name, _shards
from .errors import InputError
from .files import load_array


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
        lead = tuple(int(n) for n in raw.shape[:-1])
        for zc, rc, tc, at in _pieces(raw, ref, t, args):
            with _named(_shard_name(shards, i), lead, at):
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
