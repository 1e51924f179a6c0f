"""Per-document sums and values: what `lmmetrics.evaluate` and
`lmmetrics.Evaluator` keep when given ``document_ids``.

A document is every position whose id is the same, wherever it falls in the
batches; its sums (counted tokens, NLL, bytes, correct tokens, entropy, KL)
are float64 and merge by adding, so a document split across batches,
windows or workers is one document. `Documents` holds each
document's values (numpy arrays in the order of ``ids``) and lm-eval's
per-document aggregations (``weighted_perplexity``, ``bits_per_byte``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from ._engine.types import F64Array, I64Array
from .convert import LN2, bits_per_unit, exp, whole_counts

#: the per-document sums, one column each (counts are exact in float64 below 2^53)
COLUMNS = ("tokens", "nll_sum", "bytes", "nll_sum_bytes", "correct", "entropy_sum", "kl_tokens", "kl_sum")
_COL = {name: i for i, name in enumerate(COLUMNS)}
#: the columns that count (whole numbers)
COUNTS = ("tokens", "bytes", "correct", "kl_tokens")


class DocumentSums:
    """Sums per document id (sorted ids, a float64 row of `COLUMNS`
    each); adding a batch or another DocumentSums adds the rows of equal ids.

    Added rows wait in a chain of blocks and join the table once they
    outnumber its rows or the blocks waiting reach 1024 and a quarter of its
    rows (or when it is read: `ids`, `sums`), all at once, each
    id's rows added in the order they came (the bits of adding them one
    batch after the other): adding a batch costs what the batch holds, not
    the table (a table rebuilt each batch made a long evaluation with
    document ids quadratic). The arrays are never changed in place, so a
    `copy` shares them and the chain (it costs nothing), and what is added to
    one copy is not in the other."""

    _MIN_FOLD = 4096  # (rows waiting before they join the table, at the least)
    # (blocks waiting, at the most, or a quarter of the table's rows: a large
    # table fed small batches holds a chain of at most a quarter of its rows,
    # ~450 bytes a block to the table's 72 a row, and folds every
    # table.size // 4 batches, not every 1024: a fold costs the table, and
    # one-document batches folded every 1024 were quadratic)
    _MAX_BLOCKS = 1024

    def __init__(self, ids: Optional[I64Array] = None, sums: Optional[F64Array] = None) -> None:
        # (the table's ids and sums, the blocks added since, newest first, and
        # their rows: one attribute, replaced whole, so that an interrupt
        # leaves the old state or the new one)
        self._now: Tuple[I64Array, F64Array, Optional[_Block], int] = (
            np.zeros(0, np.int64) if ids is None else ids, np.zeros((0, len(COLUMNS))) if sums is None else sums,
            None, 0)

    @property
    def ids(self) -> I64Array:
        """The document ids, ascending."""
        return self._folded()[0]

    @property
    def sums(self) -> F64Array:
        """A row of `COLUMNS` a document, in the order of `ids`."""
        return self._folded()[1]

    def copy(self) -> DocumentSums:
        other = DocumentSums()
        other._now = self._now
        return other

    def __reduce__(self) -> Tuple[Any, Tuple[I64Array, F64Array]]:
        # (pickled, and copied by `copy`'s module, as the table with the
        # waiting blocks in it: the chain nests a block in each, deeper than
        # pickle's and deepcopy's recursion past a thousand small batches)
        return DocumentSums, self._folded()

    def add_rows(self, doc: I64Array, columns: Mapping[str, F64Array]) -> None:
        """Add per-position values (each array as long as ``doc``) under
        their documents' ids."""
        if not doc.size:
            return
        ids, inverse = np.unique(doc, return_inverse=True)
        block = np.zeros((ids.size, len(COLUMNS)))
        for name, values in columns.items():
            block[:, _COL[name]] = np.bincount(inverse, weights=values, minlength=ids.size)
        self.add(DocumentSums(ids.astype(np.int64), block))

    def add(self, other: DocumentSums) -> None:
        ids, sums = other._folded()
        if not ids.size:
            return
        table, table_sums, waiting, n = self._now
        block = _Block(ids, sums, waiting, 1 if waiting is None else waiting.depth + 1)
        self._now = (table, table_sums, block, n + ids.size)
        if n + ids.size > max(table.size, self._MIN_FOLD) or block.depth >= max(self._MAX_BLOCKS, table.size >> 2):
            self._folded()

    def _folded(self) -> Tuple[I64Array, F64Array]:
        """The table with the waiting blocks in it (folded in now, if any):
        each id's rows summed in the order they were added (np.bincount adds
        its weights in order)."""
        table, table_sums, waiting, _ = self._now
        if waiting is None:
            return table, table_sums
        parts = []
        while waiting is not None:
            parts.append(waiting)
            waiting = waiting.before
        all_ids = np.concatenate([table] + [b.ids for b in reversed(parts)])
        all_sums = np.concatenate([table_sums] + [b.sums for b in reversed(parts)])
        ids, inverse = np.unique(all_ids, return_inverse=True)
        sums = np.zeros((ids.size, len(COLUMNS)))
        for i in range(len(COLUMNS)):
            sums[:, i] = np.bincount(inverse, weights=all_sums[:, i], minlength=ids.size)
        self._now = (ids.astype(np.int64), sums, None, 0)
        return self._now[0], self._now[1]

    def state(self) -> Dict[str, List[Any]]:
        """Plain lists (picklable, JSON-ready): ``ids`` and one list a column."""
        out: Dict[str, List[Any]] = {"ids": self.ids.tolist()}
        for name, i in _COL.items():
            out[name] = self.sums[:, i].tolist()
        return out

    @classmethod
    def from_state(cls, state: Any) -> DocumentSums:
        """The inverse of `state`; ValueError when it is not one."""
        if not isinstance(state, Mapping) or set(state) != {"ids", *COLUMNS}:
            raise ValueError(f"Evaluator state: documents must be a mapping of ids and {list(COLUMNS)}")
        try:
            raw = np.asarray(state["ids"])
            cols = [np.asarray(state[c], dtype=np.float64) for c in COLUMNS]
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"Evaluator state: documents hold non-numeric values ({e})") from None
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise ValueError(f"Evaluator state: documents' ids must be a list of integers, got {raw.dtype} "
                             f"values shaped {raw.shape}")
        if raw.dtype.kind == "u" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
            raise ValueError("Evaluator state: documents' ids must fit in int64")
        ids = raw.astype(np.int64)
        for name, col in zip(COLUMNS, cols):
            if col.shape != ids.shape:
                raise ValueError(f"Evaluator state: documents hold {ids.size} ids and {name} shaped {col.shape}")
        if np.unique(ids).size != ids.size:
            raise ValueError("Evaluator state: documents need one row of sums per distinct id")
        sums = np.stack(cols, axis=1) if ids.size else np.zeros((0, len(COLUMNS)))
        if np.isnan(sums).any() or (sums < 0).any():
            raise ValueError("Evaluator state: documents' sums must be non-negative numbers")
        counts = sums[:, [_COL[c] for c in COUNTS]]
        if not (np.isfinite(counts) & (counts == np.rint(counts))).all():
            raise ValueError(f"Evaluator state: documents' {list(COUNTS)} must be whole numbers")
        tokens = sums[:, _COL["tokens"]]
        if ids.size and not ((tokens >= 1) & (sums[:, _COL["correct"]] <= tokens)
                             & (sums[:, _COL["kl_tokens"]] <= tokens)).all():
            raise ValueError("Evaluator state: each document holds a counted token, and no more correct "
                             "or kl_tokens than tokens")
        order = np.argsort(ids)
        return cls(ids[order], sums[order])

    def column(self, name: str) -> F64Array:
        return self.sums[:, _COL[name]]


@dataclass(frozen=True)
class _Block:
    """Rows added to a `DocumentSums` and not yet in its table: sorted
    distinct ids, their sums, the block added before (None: the table)
    and how many blocks wait, this one included."""

    ids: I64Array
    sums: F64Array
    before: Optional[_Block] = field(repr=False)  # (a long chain: no recursion in repr)
    depth: int  # (blocks in the chain, this one included)


def _ratio(num: F64Array, den: F64Array) -> F64Array:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


@dataclass(frozen=True, eq=False)
class Documents:
    """Each document's values, numpy arrays in the order of ``ids``.

    Only documents with a counted token are listed. ``loglikelihood`` is lm-eval's per-document value (the summed
    log-probability, ``-nll_sum``); `word_perplexity`,
    `byte_perplexity` and `corpus_bits_per_byte` aggregate them as
    lm-eval's ``weighted_perplexity`` and ``bits_per_byte`` do.

    Attributes
    ----------
    ids : numpy.ndarray
        int64 document ids, ascending.
    tokens : numpy.ndarray
        int64 counted tokens of each document.
    nll_sum, loss : numpy.ndarray
        Summed and mean NLL (nats) of each document.
    loglikelihood : numpy.ndarray
        ``-nll_sum``.
    bytes, bits_per_byte : numpy.ndarray or None
        int64 UTF-8 bytes of each document's counted targets and its bits per
        byte (with ``token_bytes``; nan without a byte).
    accuracy, entropy : numpy.ndarray or None
        Mean top-1 accuracy and entropy of each document (unless ``nll_only``).
    kl : numpy.ndarray or None
        Mean KL of each document's tokens that had reference logits (nan
        where none had).
    """

    ids: I64Array
    tokens: I64Array
    nll_sum: F64Array
    loss: F64Array
    loglikelihood: F64Array
    bytes: Optional[I64Array] = None
    bits_per_byte: Optional[F64Array] = None
    accuracy: Optional[F64Array] = None
    entropy: Optional[F64Array] = None
    kl: Optional[F64Array] = None

    @classmethod
    def from_sums(cls, s: DocumentSums, *, has_bytes: bool, full: bool, has_kl: bool) -> Documents:
        tokens = s.column("tokens")
        nll = s.column("nll_sum")
        return cls(
            ids=s.ids.copy(), tokens=np.rint(tokens).astype(np.int64), nll_sum=nll.copy(),
            loss=_ratio(nll, tokens), loglikelihood=-nll,
            bytes=np.rint(s.column("bytes")).astype(np.int64) if has_bytes else None,
            bits_per_byte=_ratio(s.column("nll_sum_bytes"), LN2 * s.column("bytes")) if has_bytes else None,
            accuracy=_ratio(s.column("correct"), tokens) if full else None,
            entropy=_ratio(s.column("entropy_sum"), tokens) if full else None,
            kl=_ratio(s.column("kl_sum"), s.column("kl_tokens")) if has_kl else None)

    def __len__(self) -> int:
        return int(self.ids.size)

    def as_dict(self) -> Dict[int, Dict[str, Optional[float]]]:
        """``{id: {name: value}}`` (JSON-ready apart from the int keys)."""
        names = ("tokens", "nll_sum", "loss", "loglikelihood", "bytes", "bits_per_byte", "accuracy",
                 "entropy", "kl")
        cols = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return {int(d): {n: (int(v[i]) if v.dtype.kind == "i" else float(v[i])) for n, v in cols.items()}
                for i, d in enumerate(self.ids)}

    def word_perplexity(self, words: Union[Mapping[int, int], Any]) -> float:
        """lm-eval's ``word_perplexity``: ``exp(-sum loglikelihood / sum words)``.

        Parameters
        ----------
        words : mapping or array_like
            Each document's word count (lm-eval counts ``re.split(r"\\s+",
            text)``): a mapping from document id, or an array in the order of
            ``ids``.

        Returns
        -------
        float
        """
        return self._per(self._weights(words, "words"))

    def byte_perplexity(self) -> float:
        """lm-eval's ``byte_perplexity``: ``exp(-sum loglikelihood / sum bytes)``
        (with ``token_bytes``)."""
        return self._per(self._weights(self._bytes(), "bytes"))

    def corpus_bits_per_byte(self) -> float:
        """lm-eval's ``bits_per_byte``: ``-sum loglikelihood / sum bytes / ln 2``
        (with ``token_bytes``), the NLL of every counted token over the
        documents' bytes. `Metrics.bits_per_byte` is nanochat's: it leaves
        out the NLL of tokens without bytes (special tokens, as a scored
        BOS or EOS), so with such tokens counted the two differ; compare
        each with the tool that reports it."""
        return bits_per_unit(float(np.sum(self.nll_sum)), self._weights(self._bytes(), "bytes"))

    def _per(self, count: float) -> float:
        """exp(sum NLL / count): inf past float's range, and for a count of 0
        (`lmmetrics.convert.corpus_metrics` likewise)."""
        return exp(float(np.sum(self.nll_sum)) / count) if count else math.inf

    def _bytes(self) -> I64Array:
        if self.bytes is None:
            raise ValueError("per-document bytes need token_bytes (evaluate(..., token_bytes=...))")
        return self.bytes

    def _weights(self, w: Any, name: str) -> float:
        if isinstance(w, Mapping):
            missing = [int(d) for d in self.ids if int(d) not in w]
            if missing:
                raise ValueError(f"{name} has no count for document(s) {missing[:5]}")
            return float(np.sum(whole_counts(name, [w[int(d)] for d in self.ids])))
        arr = whole_counts(name, w).reshape(-1)
        if arr.size != self.ids.size:
            raise ValueError(f"{name} has {arr.size} counts for {self.ids.size} documents")
        return float(np.sum(arr))
