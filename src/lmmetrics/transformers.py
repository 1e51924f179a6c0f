"""Metrics of a Hugging Face ``Trainer``'s evaluation, without its logits.

``Trainer(..., **TrainerMetrics().hooks())`` gives ``trainer.evaluate()``
the perplexity, token-weighted loss, accuracy, entropy and bits per byte of
the evaluation set, each with its standard error, where the Trainer would
otherwise keep every batch's ``(B, T, V)`` logits until the end.

``preprocess_logits_for_metrics`` reduces each batch, on its device, to one
float64 row of sums per sequence (that sequence's ``lmmetrics.Evaluator``
state: counts, NLL, entropy and byte sums and their squares, rank hits,
calibration bins); the Trainer gathers those rows across ranks with
``gather_for_metrics``, which drops the samples a distributed sampler
repeated, row by row. ``compute_metrics`` adds the rows up and reports them
through an Evaluator, so every number and standard error is the library's.

Needs torch (the rows are tensors), not transformers: ``import lmmetrics``
imports neither, and this module does not import transformers.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ._engine.checks import check_shift
from ._engine.types import F64Array
from .documents import COLUMNS
from .evaluation import Evaluator, Metrics

__all__ = ["TrainerMetrics"]

#: the fields of Metrics.as_dict() that TrainerMetrics reports, under their Trainer names
_REPORTED = {"tokens": "tokens", "loss": "token_loss", "perplexity": "perplexity", "accuracy": "accuracy",
             "entropy": "entropy", "bits_per_byte": "bits_per_byte", "mean_reciprocal_rank": "mean_reciprocal_rank",
             "ece": "ece"}
#: the value a Trainer pads predictions with (pad_across_processes, nested concatenation)
_PAD = -100.0


def _the_logits(outputs: Sequence[Any], labels: Any) -> Any:
    """The logits among the outputs the Trainer passes as a tuple (every
    field of the model's output but the loss and ``ignore_keys``, in field
    order): the first when it is a (B, T, V) tensor for labels (B, T) (a
    plain causal LM's, where the logits come first), else the one such
    tensor (a mixture of experts puts its ``aux_loss`` first); no such
    tensor, or several after a first that is not one, is an error naming
    the outputs' shapes."""
    lead = tuple(getattr(labels, "shape", ()))[:2]

    def fits(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() == 3 and tuple(x.shape[:2]) == lead

    if outputs and fits(outputs[0]):
        return outputs[0]
    found = [x for x in outputs if fits(x)]
    if len(found) == 1:
        return found[0]
    shapes = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in outputs)
    said = (f"TrainerMetrics needs the model's logits (batch, time, vocabulary) for labels of shape {lead}: "
            f"the model's outputs reach it as a tuple ({shapes})")
    if not found and any(isinstance(x, torch.Tensor) and x.dim() == 3 for x in outputs):
        raise ValueError(f"{said}, none of which has the labels' (batch, time): the labels must cover the "
                         f"logits' positions")
    what = "none is" if not found else f"{len(found)} are"
    raise ValueError(f"{said}, of which {what} shaped so; leave the other outputs out with "
                     f"trainer.evaluate(ignore_keys=[...]) (their field names) or the model config's "
                     f"keys_to_ignore_at_inference")


def _no_encoder_state(outputs: Sequence[Any], logits: Any, labels: Any) -> None:
    """A ValueError when the outputs hold, beside the logits, another 3-D
    tensor of the labels' batch (an encoder-decoder model's
    ``encoder_last_hidden_state``): such a model scores position t against
    label t, a causal LM against label t + 1, and the tensors alone do not
    say which the model is."""
    batch = tuple(getattr(labels, "shape", ()))[:1]
    other = [x for x in outputs if x is not logits and isinstance(x, torch.Tensor) and x.dim() == 3
             and tuple(x.shape[:1]) == batch]
    if other:
        raise ValueError(f"TrainerMetrics: the model's outputs hold, beside the logits {tuple(logits.shape)}, a "
                         f"tensor {tuple(other[0].shape)} of the same batch, as an encoder-decoder model's "
                         f"encoder_last_hidden_state (T5, BART: its decoder reads the labels shifted right, "
                         f"position t predicts label t): say TrainerMetrics(shift=False) for an "
                         f"encoder-decoder model, or shift=True for a causal LM (position t predicts label t + 1)")


def _leaves(state: Mapping[str, Any]) -> List[Tuple[str, float]]:
    """An Evaluator state_dict's numbers in order, each with its name
    (``rank.hits``, ...), as floats; the ranks' list of k, fixed by the
    settings, is left out."""
    out: List[Tuple[str, float]] = []
    for key, v in state.items():
        for name, x in (v.items() if isinstance(v, Mapping) else [(None, v)]):
            if key == "rank" and name == "k":
                continue
            label = key if name is None else f"{key}.{name}"
            out.extend((label, float(e)) for e in (x if isinstance(x, list) else [x]))
    return out


def _unflat(template: Mapping[str, Any], values: F64Array) -> Dict[str, Any]:
    """The inverse of ``_leaves`` for a state shaped like ``template``: the
    numbers in its order, integers (rounded) where the template has
    integers."""
    it = iter(values.tolist())

    def take(like: Any) -> Any:
        if isinstance(like, list):
            return [take(e) for e in like]
        v = next(it)
        return int(round(v)) if isinstance(like, int) else v

    out: Dict[str, Any] = {}
    for key, v in template.items():
        if isinstance(v, Mapping):
            out[key] = {name: x if key == "rank" and name == "k" else take(x) for name, x in v.items()}
        else:
            out[key] = take(v)
    return out


class TrainerMetrics:
    """A Hugging Face ``Trainer``'s ``preprocess_logits_for_metrics`` and
    ``compute_metrics``: the lmmetrics numbers of an evaluation, summed over
    tokens in float64, without keeping the logits.

    ``Trainer(model=..., args=..., eval_dataset=..., **tm.hooks())``; then
    ``trainer.evaluate()`` reports, each prefixed ``eval_`` by the Trainer:
    ``tokens`` (counted tokens), ``sequences`` (sequences evaluated, each
    once across ranks), ``token_loss`` (the mean NLL over all counted
    tokens), ``perplexity`` (``exp(token_loss)``), ``accuracy`` (top-1),
    ``entropy`` (mean predictive entropy), ``bits_per_byte`` (with
    ``token_bytes``), ``top_<k>_accuracy`` and ``mean_reciprocal_rank``
    (with ``top_k``), ``ece`` (with ``calibration_bins``). Each mean has
    ``<name>_stderr``, its standard error with tokens taken as independent
    (as ``lmmetrics.Metrics.stderr``), and ``<name>_stderr_sequences``,
    the standard error with each sequence a cluster of dependent tokens (as
    ``lmmetrics.Metrics.stderr_documents``, one document a sequence:
    usually the larger, and the honest one). ``metrics`` holds the whole
    ``lmmetrics.Metrics`` of the last evaluation (per-sequence values
    in ``per_document``, whose ``ids`` are the sequences' places in the
    order the Trainer gathered them; a sequence with no counted token has
    no entry).

    Labels are the Trainer's (Hugging Face's unshifted ``labels``: position
    t is scored against label t + 1), ``-100`` (and any negative label)
    not counted. An encoder-decoder model (T5, BART) scores position t
    against label t (its decoder reads the labels shifted right): give it
    ``shift=False``. Works with ``batch_eval_metrics=True`` (the rows are added
    up batch by batch, reported at the last one), with
    ``eval_accumulation_steps``, with ``eval_do_concat_batches=False`` and
    on several ranks (DDP). Several threads may call the hooks of one
    TrainerMetrics (each call holds its lock); with ``batch_eval_metrics``
    the rows added up are those of one evaluation, so two evaluations at
    once take a TrainerMetrics each.

    Parameters
    ----------
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]`` is the UTF-8 byte length of token ``v``, 0 for
        special tokens, one entry per column of the logits
        (``lmmetrics.token_bytes(tokenizer, size=model.config.vocab_size)``).
        Gives ``bits_per_byte``.
    top_k : int, sequence of int or None, default None
        Also ``top_<k>_accuracy`` for each k and ``mean_reciprocal_rank``.
    calibration_bins : int or None, default None
        Also ``ece`` over this many equal-width confidence bins.
    ignore_index : int or None, default -100
        Labels equal to it are not counted, nor is any negative label.
    shift : bool or None, default None
        ``True``: position t of the logits is scored against label t + 1
        (a causal LM's labels); ``False``: against label t (an
        encoder-decoder model's, whose decoder reads the labels shifted
        right). None (not said) is True, and an error at the first batch
        whose outputs hold, beside the logits, another (batch, time, ...)
        tensor of the labels' batch, as an encoder-decoder model's
        ``encoder_last_hidden_state``: say which then.

    Raises
    ------
    ValueError, TypeError
        An option out of range or of the wrong type (as for
        ``lmmetrics.Evaluator``).

    Examples
    --------
    What the Trainer does with the two hooks, by hand:

    >>> import torch
    >>> from types import SimpleNamespace
    >>> from lmmetrics.transformers import TrainerMetrics
    >>> tm = TrainerMetrics()
    >>> logits = torch.randn(2, 5, 10)                           # a batch's logits (B, T, V)
    >>> labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6]])
    >>> rows = tm.preprocess_logits_for_metrics(logits, labels)   # one row of sums a sequence
    >>> rows.shape[0], rows.dtype
    (2, torch.float64)
    >>> m = tm.compute_metrics(SimpleNamespace(predictions=rows.numpy(), label_ids=labels.numpy()))
    >>> m["tokens"], m["sequences"]
    (6, 2)
    >>> list(m)                     # the Trainer logs them as eval_tokens, eval_sequences, ...
    ['tokens', 'sequences', 'token_loss', 'token_loss_stderr', 'token_loss_stderr_sequences', 'perplexity',
     'accuracy', 'accuracy_stderr', 'accuracy_stderr_sequences', 'entropy', 'entropy_stderr',
     'entropy_stderr_sequences']
    """

    def __init__(self, token_bytes: Any = None, top_k: Union[None, int, Iterable[int]] = None,
                 calibration_bins: Optional[int] = None, ignore_index: Optional[int] = -100,
                 shift: Optional[bool] = None) -> None:
        self._shift = check_shift(shift)
        self._evaluator = Evaluator(token_bytes=token_bytes, ignore_index=ignore_index,
                                    shift=self._shift is not False, top_k=top_k, calibration_bins=calibration_bins)
        self._template = self._evaluator._state_now()
        # a row: 1 (one sequence), then the sequence's state, number by number
        names = ["sequences"] + [name for name, _ in _leaves(self._template)]
        #: the width of a row
        self.width = len(names)
        self._doc_columns = [names.index(c) for c in COLUMNS]  # the per-sequence sums, in COLUMNS' order
        self._tokens_column = names.index("tokens")
        #: the ``lmmetrics.Metrics`` of the last evaluation (None before one)
        self.metrics: Optional[Metrics] = None
        self.reset()

    def reset(self) -> None:
        """Forget the rows added so far (``batch_eval_metrics``): the next
        evaluation starts afresh. Done after each result; call it after an
        evaluation that stopped before its last batch."""
        with self._evaluator._lock:
            self._total: F64Array = np.zeros(self.width)
            self._docs: List[F64Array] = []
            # each counted sequence's place among the rows added (its id in per_document)
            self._ids: List[Any] = []
            self._seen = 0

    def hooks(self) -> Dict[str, Callable[..., Any]]:
        """The Trainer's keyword arguments: ``Trainer(..., **tm.hooks())``.

        Returns
        -------
        dict
            ``{"preprocess_logits_for_metrics": ..., "compute_metrics": ...}``.
        """
        return {"preprocess_logits_for_metrics": self.preprocess_logits_for_metrics,
                "compute_metrics": self.compute_metrics}

    def preprocess_logits_for_metrics(self, logits: Any, labels: Any) -> torch.Tensor:
        """A batch's logits made one row of sums per sequence.

        Parameters
        ----------
        logits : torch.Tensor (B, T, V) or tuple
            The model's logits, in any float dtype, on any device; or the
            tuple of the model's outputs the Trainer passes when there are
            several (its logits: the first element when that is a (B, T,
            V) tensor, as in a plain model's outputs, else the one (B, T,
            V) tensor among them, as after a mixture of experts'
            ``aux_loss``).
        labels : torch.Tensor (B, T)
            The batch's unshifted labels, ``-100`` where not counted (also
            where the Trainer padded the batch across ranks).

        Returns
        -------
        torch.Tensor (B, width)
            float64, on the logits' device: each sequence's sums, for the
            Trainer to gather (it never sees a ``(B, T, V)`` result).

        Raises
        ------
        ValueError
            No labels (the dataset has no ``labels``), several label
            tensors, logits that are not (B, T, V) (or outputs where no
            element, or several, could be the logits: leave the others out
            with ``trainer.evaluate(ignore_keys=[...])``), outputs that
            hold an encoder-decoder model's encoder state beside the
            logits while ``shift`` was not said, or what
            ``lmmetrics.Evaluator.update`` refuses (a label >= V, NaN
            logits at a counted position, shapes that do not match).
        """
        if labels is None:
            raise ValueError("TrainerMetrics needs labels: the evaluation batches have none (give the dataset "
                             "a 'labels' column, or set TrainingArguments(label_names=[...]))")
        if isinstance(labels, (tuple, list)):
            raise ValueError(f"TrainerMetrics needs one labels tensor, got a tuple of {len(labels)} "
                             f"(TrainingArguments.label_names names several)")
        if isinstance(logits, (tuple, list)):
            outputs, logits = logits, _the_logits(logits, labels)
            if self._shift is None:
                _no_encoder_state(outputs, logits, labels)
        if getattr(logits, "ndim", None) != 3:
            raise ValueError(f"TrainerMetrics needs logits shaped (batch, time, vocabulary), got shape "
                             f"{tuple(getattr(logits, 'shape', ()))}")
        states = self._evaluator._sequence_states(logits, labels)  # (one pass over the batch)
        rows = [[1.0] + [v for _, v in _leaves(st)] for st in states]
        return torch.tensor(rows, dtype=torch.float64, device=logits.device).reshape(-1, self.width)

    def _rows(self, predictions: Any) -> F64Array:
        """The gathered predictions as (N, width) float64 rows, the rows of
        padding dropped."""
        if isinstance(predictions, (list, tuple)):  # eval_do_concat_batches=False: one array a batch
            parts = [self._rows(p) for p in predictions]
            return np.concatenate(parts) if parts else np.zeros((0, self.width))
        if isinstance(predictions, torch.Tensor):
            predictions = predictions.detach().cpu().numpy()
        rows: F64Array = np.asarray(predictions, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"compute_metrics got predictions of shape {rows.shape}, not TrainerMetrics' rows "
                             f"(N, {self.width}): give the Trainer both hooks, Trainer(..., **tm.hooks()), from "
                             f"one TrainerMetrics")
        rows = rows[~np.all(rows == _PAD, axis=1)]
        if rows.size and not np.all(rows[:, 0] == 1.0):
            raise ValueError("compute_metrics got rows that are neither TrainerMetrics' nor the Trainer's "
                             "padding: give the Trainer both hooks from one TrainerMetrics")
        return rows

    def compute_metrics(self, eval_pred: Any, compute_result: Optional[bool] = None) -> Dict[str, float]:
        """The metrics of the gathered rows.

        Parameters
        ----------
        eval_pred : transformers.EvalPrediction
            Its ``predictions`` are the rows of
            ``preprocess_logits_for_metrics`` (numpy, or a tensor with
            ``batch_eval_metrics``; the Trainer's padding rows of -100 are
            dropped); ``label_ids`` are not read.
        compute_result : bool or None, default None
            Passed by the Trainer with ``batch_eval_metrics=True``: False
            adds the batch's rows and returns ``{}``, True adds them and
            returns the metrics of every row added since the last result.
            None (without ``batch_eval_metrics``): the metrics of these rows.

        Returns
        -------
        dict of str to float
            The keys of the class description (the Trainer prefixes
            ``eval_``); ``tokens`` and ``sequences`` are integers. Never
            ``loss``, which would replace the Trainer's ``eval_loss``.
        """
        rows = self._rows(eval_pred.predictions)
        with self._evaluator._lock:  # (threads: the rows of one call added, and its result made, at a time)
            return self._add_rows(rows, compute_result)

    def _add_rows(self, rows: F64Array, compute_result: Optional[bool]) -> Dict[str, float]:
        if compute_result is None:
            self.reset()
        self._total += rows.sum(axis=0)
        counted = rows[:, self._tokens_column] > 0
        self._docs.append(rows[counted][:, self._doc_columns])
        self._ids.append(self._seen + np.flatnonzero(counted))
        self._seen += rows.shape[0]
        if compute_result is False:
            return {}
        total, docs, ids = self._total, np.concatenate(self._docs), np.concatenate(self._ids)
        self.reset()
        state = _unflat(self._template, total[1:])
        state["documents"] = {"ids": ids.tolist(),
                              **{c: docs[:, i].tolist() for i, c in enumerate(COLUMNS)}}
        ev = self._evaluator
        ev.load_state_dict(state)
        m = self.metrics = ev.compute()
        ev.reset()
        out: Dict[str, float] = {}
        for key, value in m.as_dict().items():
            base, _, tail = key.partition("_stderr")
            name = _REPORTED.get(base) or (base if base.startswith("top_") and base.endswith("_accuracy") else None)
            if name is None or value is None:
                continue
            if key == base:
                suffix = ""
            elif tail in ("", "_documents"):
                suffix = "_stderr" if not tail else "_stderr_sequences"
            else:
                continue
            out[name + suffix] = value if isinstance(value, int) else float(value)
            if key == "tokens":
                out["sequences"] = int(round(total[0]))
        return out
