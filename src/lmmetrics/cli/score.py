"""`lmmetrics score`: every metric of saved logits, shard by shard."""
from __future__ import annotations

import argparse
import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from ..evaluation import Evaluator
from ..ranking import Calibration, calibration_of
from .common import _json, _load_shard, _named, _opened, _pieces, _shard_name, _shards
from .export import TokenWriter
from .export import check_path as check_token_path
from .files import load_array
from .plot import check_path as check_plot_path
from .plot import plot


def _score(args: argparse.Namespace) -> int:
    specs = [("LOGITS", args.logits, "logits"), ("TARGETS", args.targets, "targets")]
    if args.reference is not None:
        specs.append(("--reference", args.reference, "reference logits"))
    shards = _shards(*specs)
    tb = load_array(args.token_bytes, "token_bytes") if args.token_bytes else None
    ev = Evaluator(token_bytes=tb, ignore_index=args.ignore_index, softcap=args.softcap,
                   shift=args.shift, num_threads=args.threads)
    inputs = [p for shard in shards for p in shard] + ([args.token_bytes] if args.token_bytes else [])
    out = _TokenOutputs(args, inputs)  # --per-token, --plot

    def load(paths: Tuple[str, ...], vocab: Optional[int]) -> Tuple[Any, Any, npt.NDArray[np.integer[Any]]]:
        return _load_shard(paths, vocab, args)

    try:
        for i, (raw, ref, t) in enumerate(_opened(shards, load)):
            if i == 0:
                ev.check_vocab(int(raw.shape[-1]))  # a vocab / token_bytes mismatch fails before any work
            out.shard(raw.shape, t)
            lead = tuple(int(n) for n in raw.shape[:-1])
            for zc, rc, tc, at in _pieces(raw, ref, t, args):
                with _named(_shard_name(shards, i), lead, at):
                    out.rows(ev._update_rows(zc, tc, reference_logits=rc, **out.wanted))
        m = ev.compute()
        out.close(m)
    except BaseException:
        out.abort()
        raise
    print(_json(m.as_dict()) if args.json else _table(m.as_dict()))
    return 0


class _TokenOutputs:
    """score's per-token outputs: --per-token (a file of per-position values,
    written chunk by chunk) and --plot (per-position mean NLL, calibration)."""

    def __init__(self, args: argparse.Namespace, inputs: Sequence[str] = ()) -> None:
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
            check_token_path(args.per_token, inputs)
            self.wanted["rank"] = True
        if args.plot:
            check_plot_path(args.plot, inputs)
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
