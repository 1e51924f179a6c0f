"""lm-evaluation-harness's Hugging Face model with lazy logits:
`LazyHFLM`, registered with lm-eval as ``"hf-lmmetrics"`` when this
module is imported.

``LazyHFLM`` is lm-eval's ``HFLM`` (``lm_eval.models.huggingface``) with one
step changed: where ``HFLM._loglikelihood_tokens`` takes the model's
``(B, T, V)`` logits and their ``(B, T, V)`` log-softmax, it runs the model
up to its output head (`lmmetrics.model_logits`) and scores each
continuation with `lmmetrics.loglikelihood`, which applies the head
only at the positions a continuation token is scored at, a bounded chunk at
a time. Everything else is ``HFLM``'s: arguments, tokenization, batching and
sorting, left truncation, right padding, the one-token-continuation cache,
``loglikelihood_rolling`` (which goes through ``_loglikelihood_tokens``),
``generate_until``, distributed request sharding. ``batch_size="auto"``
probes the lazy path, so it finds the larger batches that fit without the
``(B, T, V)`` tensors.

Needs lm-eval with its Hugging Face extra (``pip install 'lm-eval[hf]'``:
``pip install lm-eval`` alone has no accelerate, which lm-eval's ``HFLM``
imports); ``import lmmetrics`` alone does not
import this module, nor lm-eval. From the command line, for lm-eval versions
without model plugins::

    python -m lmmetrics.lm_eval run --model hf-lmmetrics --model_args pretrained=... --tasks ...
"""
from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from lm_eval.api.registry import register_model

try:
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # lm-eval without its hf extra: no accelerate (or peft)
    raise ImportError(f"lmmetrics.lm_eval needs lm-eval's Hugging Face model, which needs its hf extra: "
                      f"pip install 'lm-eval[hf]' ({e})") from e
from lm_eval.models.utils import Collator
from tqdm import tqdm

from ._engine.lazy import _findings, _model_logits, _Transform, model_logits
from .metrics import loglikelihood

try:  # lm-eval >= 0.4.10 keeps it in utils_hf; earlier versions in utils
    from lm_eval.models.utils_hf import pad_and_concat
except ImportError:  # pragma: no cover
    from lm_eval.models.utils import pad_and_concat

__all__ = ["LazyHFLM", "main"]

NAME = "hf-lmmetrics"
# HFLM's own logger: the truncation warning reads as HFLM's
_hf_logger = logging.getLogger("lm_eval.models.huggingface")
_UNDECIDED = object()
_Request = Tuple[Any, List[int], List[int]]


class LazyHFLM(HFLM):
    """lm-eval's ``HFLM`` whose log-likelihoods never hold the ``(B, T, V)``
    logits or log-probabilities: registered as ``"hf-lmmetrics"``.

    Takes ``HFLM``'s arguments, unchanged (``pretrained``, ``tokenizer``,
    ``batch_size`` (an int, ``"auto"`` or ``"auto:N"``), ``max_batch_size``,
    ``max_length``, ``dtype``, ``device``, ``logits_cache``, ...).
    ``softmax_dtype`` is ignored by the lazy path, which computes the
    log-softmax in float32 (float64 for a float64 model) and sums in float64:
    the numbers of ``HFLM(softmax_dtype="float32")``, which ``HFLM``'s default
    rounds to the model's dtype (bfloat16: 8 significant bits).

    ``is_greedy`` is ``argmax == continuation`` at every continuation
    position (the lowest index wins ties, as ``argmax``), as ``HFLM``'s. Each
    member of a one-token-continuation cache group is scored at its own
    trailing positions (``HFLM`` with ``logits_cache=True`` scores a shorter
    member of a group at the representative's leading positions).

    Seq2seq models, tensor-parallel heads, models split over devices and
    models `lmmetrics.model_logits` refuses (an adapter, hook or
    quantized layer on the head, prompt tuning, an unknown output transform,
    an offloaded head) are computed by ``HFLM`` itself, after a one-line
    warning saying why.

    As ``HFLM``, one instance serves one thread at a time: while
    ``batch_size="auto"`` probes the largest batch, its forward calls return
    a stand-in for the logits (a call of another thread then scores that).

    Examples
    --------
    >>> import lmmetrics.lm_eval, lm_eval.api.registry
    >>> lm_eval.api.registry.get_model("hf-lmmetrics") is lmmetrics.lm_eval.LazyHFLM
    True
    """

    # the lazy path's findings (model_logits' check: factor, soft cap,
    # logits dtype) once decided, or None: HFLM computes
    _lmmetrics_plan: Any = _UNDECIDED
    # True while _detect_batch_size runs HFLM's probe through _model_call
    _lmmetrics_probing: bool = False

    def _lazy_plan(self) -> Optional[_Transform]:
        """model_logits' findings for this model (checked once, on a probe of
        at most 8 tokens), or None after a warning when HFLM must compute."""
        if self._lmmetrics_plan is not _UNDECIDED:
            plan: Optional[_Transform] = self._lmmetrics_plan
            return plan
        why = self._refusal()
        plan = None
        if why is None:
            try:  # (a model without input embeddings transformers can find: NotImplementedError)
                vocab = int(self.model.get_input_embeddings().weight.shape[0])
                first = self.prefix_token_id if self.prefix_token_id is not None else 0
                n = max(1, min(8, int(self.max_length)))  # (a model with fewer positions cannot read 8)
                probe = torch.tensor([[first] + list(range(1, n))], dtype=torch.long, device=self.device) % vocab
                with self._forward_context():
                    plan = _findings(model_logits(self.model, probe))
            except (TypeError, ValueError, NotImplementedError) as e:
                why = str(e).split("\n")[0] or type(e).__name__
        if plan is None:
            warnings.warn(f"{NAME}: computing log-likelihoods with HFLM's (B, T, V) logits: {why}", stacklevel=3)
        self._lmmetrics_plan = plan
        return plan

    def _refusal(self) -> Optional[str]:
        """Why the lazy path cannot serve this model before trying it, or None."""
        if getattr(self, "backend", "causal") != "causal":
            return f"a {self.backend} model (the lazy path is for causal LMs)"
        model = self.model
        if (getattr(model, "_tp_size", None) or 1) > 1 or \
                type(getattr(model.get_output_embeddings(), "weight", None)).__name__ == "DTensor":
            return "a tensor-parallel model (its head's weight is sharded)"
        devices = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
        if len(devices) > 1:
            return f"a model split over devices {sorted(devices)}"
        return None

    def _forward_context(self) -> Any:
        """HFLM's _model_call context: no grad, its autocast."""
        dtype = getattr(self, "mixed_precision_dtype", None)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None))
        return stack

    def _lazy_logits(self, inps: torch.Tensor, plan: _Transform) -> Any:
        """Lazy logits of the (B, T) batch: the forward up to the head."""
        with self._forward_context():
            return _model_logits(self.model, inps, None, False, 8, None, found=plan)

    def _model_call(self, inps: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                    labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """HFLM's, except in _detect_batch_size's probe: there the lazy path
        scores every position of the batch, and a (B, T, 1) stand-in for the
        logits is returned."""
        if not self._lmmetrics_probing:
            out: torch.Tensor = super()._model_call(inps, attn_mask, labels)
            return out
        plan = self._lazy_plan()
        assert plan is not None
        loglikelihood(self._lazy_logits(inps, plan), inps, shift=False)
        return torch.zeros((*inps.shape, 1), device=inps.device)

    def _detect_batch_size(self, requests: Optional[Sequence[Any]] = None, pos: int = 0) -> int:
        """HFLM's search for the largest batch that runs (from
        ``max_batch_size`` down, halving on out-of-memory errors), its probe
        being the lazy path on every position."""
        if self._lazy_plan() is None:
            return int(super()._detect_batch_size(requests, pos))
        self._lmmetrics_probing = True
        try:
            return int(super()._detect_batch_size(requests, pos))
        finally:
            self._lmmetrics_probing = False

    def _loglikelihood_tokens(self, requests: List[_Request], disable_tqdm: bool = False,
                              override_bs: Optional[int] = None) -> List[Tuple[float, bool]]:
        """HFLM's: the requests sorted, batched and cached as there, each
        continuation scored by `lmmetrics.loglikelihood` on lazy logits."""
        plan = self._lazy_plan()
        if plan is None:
            out: List[Tuple[float, bool]] = super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            return out

        def _collate(req: _Request) -> Tuple[int, Tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        def _lookup_one_token_cont(req: _Request) -> List[int]:
            return req[-2] + req[-1][:-1]

        re_ord = Collator(requests, sort_fn=_collate, group_by="contexts" if self.logits_cache else None,
                          group_fn=_lookup_one_token_cont)
        n_reordered = len(re_ord)
        batch_size = self.batch_size if self.batch_size != "auto" else override_bs if override_bs is not None else 0
        batch_fn = self._batch_scheduler if self.batch_size == "auto" and n_reordered > 0 and not override_bs \
            else None
        if batch_fn is not None:
            self.batch_sizes: Dict[int, int] = {}  # (detected afresh for these requests, as HFLM does)
        res: List[Tuple[float, bool]] = []
        pbar = tqdm(total=len(requests), disable=(disable_tqdm or (self.rank != 0)),
                    desc="Running loglikelihood requests")
        # a zero-width stand-in for a row's logits, for the Collator's cache bookkeeping
        no_logits = torch.empty((1, 1, 0))
        for chunk in re_ord.get_batched(n=batch_size, batch_fn=batch_fn):
            inps, inplens = [], []
            for _, context_enc, continuation_enc in chunk:
                assert len(context_enc) > 0
                assert len(continuation_enc) > 0
                assert len(continuation_enc) <= self.max_length
                total_length = len(context_enc) + len(continuation_enc)
                if total_length > self.max_length + 1:
                    _hf_logger.warning(f"Combined length of context ({len(context_enc)}) and continuation "
                                       f"({len(continuation_enc)}) exceeds model's maximum length "
                                       f"({self.max_length}). Truncating {total_length - self.max_length + 1} "
                                       f"tokens from the left.")
                inp = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
                inps.append(torch.tensor(inp, dtype=torch.long, device=self.device))
                inplens.append(len(inp))
            width = max(inplens)
            batched = pad_and_concat(width, inps, padding_side="right")
            lazy = self._lazy_logits(batched, plan)
            # each row's requests: one, or a cache group's members (same
            # tokens but the last; each scored at its own trailing positions)
            members = [[(s, c) for s, c, _ in re_ord.get_cache(req_str=req_str, cxt_toks=ctx, cont_toks=cont,
                                                                logits=no_logits)]
                       for req_str, ctx, cont in chunk]
            answers: List[List[Tuple[float, bool]]] = [[] for _ in members]
            for k in range(max(len(m) for m in members)):  # the k-th member of every row at once
                labels = [[-100] * width for _ in members]
                for r, m in enumerate(members):
                    if k < len(m):
                        cont = m[k][1]
                        labels[r][inplens[r] - len(cont):inplens[r]] = cont
                logprob, greedy = loglikelihood(lazy, torch.tensor(labels, device=batched.device), shift=False)
                for r, (lp, g) in enumerate(zip(logprob.tolist(), greedy.tolist())):
                    if k < len(members[r]):
                        answers[r].append((float(lp), bool(g)))
            for m, row_answers in zip(members, answers):
                for (req_str, _), answer in zip(m, row_answers):
                    res.append(answer)
                    if req_str is not None:  # (loglikelihood_rolling's windows: cached per document there)
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
                    pbar.update(1)
        pbar.close()
        ordered: List[Tuple[float, bool]] = re_ord.get_original(res)
        return ordered


def main(argv: Optional[Sequence[str]] = None) -> None:
    """lm-eval's command line with ``"hf-lmmetrics"`` registered:
    ``python -m lmmetrics.lm_eval run --model hf-lmmetrics --model_args ...
    --tasks ...`` takes lm-eval's own arguments (``lm-eval --help``)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    # run as a script, this file is a second copy of the module: the model
    # is registered by importing the module itself
    from lmmetrics.lm_eval import main as _main

    _main()
else:
    register_model(NAME)(LazyHFLM)
