"""Per-token NLL of a text longer than a model's context, by windows, in the
conventions of the numbers people compare against: lm-evaluation-harness's
rolling log-likelihood, the transformers guide "Perplexity of fixed-length
models", and the longest context for every token."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union, overload

import numpy as np

from ._engine import RowResults
from ._engine.checks import check_positive_int, check_token_id
from ._engine.lazy import _findings, _model_logits
from .evaluation import Evaluator, Metrics
from .metrics import _per_position

if TYPE_CHECKING:
    import torch

    #: a token_bytes table as sliding_window_nll takes it (anything but None)
    TokenBytes = Union[np.ndarray[Any, Any], torch.Tensor, Sequence[int]]

CONVENTIONS = ("lm-eval", "hf-guide", "max-context")

# A window: the model reads seq[a:b]; it scores tokens seq[f:g], token k
# from the logits at window position k - a - 1.
_Window = Tuple[int, int, int, int]


def _check_stride(stride: Any, window: int, window_name: str) -> int:
    """stride as a positive int no larger than the window (named
    ``window_name``): a larger step would leave tokens unscored."""
    step: int = check_positive_int("stride", stride)
    if step > window:
        raise ValueError(f"stride ({step}) must not exceed {window_name} ({window}): "
                         f"tokens between windows would not be scored")
    return step


def _lm_eval_windows(n: int, max_length: int, stride: int) -> List[_Window]:
    """lm_eval.utils.get_rolling_token_windows(seq[1:], prefix_token=seq[0],
    max_seq_len=max_length, context_len=max_length - stride + 1), each made
    disjoint (make_disjoint_window), as the model reads them: the first window
    reads seq[0:m] and predicts seq[1:m + 1]; each later one predicts the next
    ``stride`` (or fewer, at the end) tokens from a full window of
    ``max_length`` tokens ending just before the last of them."""
    total = n - 1  # tokens to predict: seq[1:]
    if total <= 0:
        return []
    first = min(max_length, total)
    out = [(0, first, 1, first + 1)]
    predicted = first
    while predicted < total:
        pred_len = min(total - predicted, stride)
        end = predicted + pred_len  # in seq[1:] coordinates
        out.append((end - max_length, end, predicted + 1, end + 1))
        predicted = end
    return out


def _hf_guide_windows(n: int, max_length: int, stride: int) -> List[_Window]:
    """The guide's loop: windows seq[begin:end] for begin = 0, stride, ...;
    the labels before prev_end are -100 and the model's label shift drops the
    window's first label, so the window scores seq[max(prev_end, begin + 1):end]."""
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first, end))
        prev_end = end
        if end == n:
            break
    return out


def _max_context_windows(n: int, max_length: int, stride: int) -> List[_Window]:
    """Windows seq[b:b + max_length] for b = 0, stride, ...; a window predicts
    tokens b + 1 .. b + max_length (its last logits predict the token after
    it), and each token is scored by the first window that reaches it."""
    out = []
    next_tok = 1
    for begin in range(0, max(n - 1, 0), stride):
        end = min(begin + max_length, n)
        first, last = max(next_tok, begin + 1), min(end, n - 1)
        if first > last:
            continue
        out.append((begin, end, first, last + 1))
        next_tok = last + 1
        if next_tok == n:
            break
    return out


_WINDOWS = {"lm-eval": _lm_eval_windows, "hf-guide": _hf_guide_windows,
            "max-context": _max_context_windows}

# A window of one of several sequences: (sequence, a, b, f, g), the model
# reading sequences[sequence][a:b] and scoring its tokens f..g-1.
_Item = Tuple[int, int, int, int, int]


def score_windows(model: Any, sequences: Sequence[torch.Tensor], items: List[_Item], ev: Evaluator, *,
                  batch_size: int, materialize: bool, progress: bool, documents: bool, desc: str,
                  each: Optional[Callable[[List[_Item], RowResults], None]] = None) -> None:
    """Run the model on the windows ``items``, ``batch_size`` at a time
    (under ``torch.no_grad()``; a batch's shorter windows padded on the
    right, after every scored position, which a causal model's other
    positions do not see), and add each batch's scored tokens to ``ev``
    (with ``documents``, each window's sequence index as its document id);
    ``each(batch, results)`` gets the batch's per-row results, rows laid out
    (window, position). ``materialize=False`` never holds a batch's logits:
    `lmmetrics.model_logits`, checked against the model's forward on
    the first batch only."""
    import torch

    on_cpu = [seq.to("cpu", torch.long) for seq in sequences]
    found: Any = None
    bar = _progress_bar(len(items), progress, desc)
    with torch.no_grad(), bar if bar is not None else contextlib.nullcontext():
        for s in range(0, len(items), batch_size):
            batch = items[s:s + batch_size]
            if bar is not None:
                bar.update(len(batch))
            width = max(b - a for _, a, b, _, _ in batch)
            rows = []
            for i, a, b, _, _ in batch:
                w = sequences[i][a:b]
                if b - a < width:  # right padding, after every scored position
                    w = torch.cat([w, w[-1:].expand(width - (b - a))])
                rows.append(w)
            # (lazy: the first batch's check holds for the next ones)
            logits: Any = (_returned_logits(model(torch.stack(rows))) if materialize
                           else _model_logits(model, torch.stack(rows), None, True, 8, None, found=found))
            found = found if materialize or found is not None else _findings(logits)
            if len(logits.shape) != 3 or tuple(logits.shape[:2]) != (len(batch), width):
                raise ValueError(f"model returned logits of shape {tuple(logits.shape)} for "
                                 f"windows of shape {(len(batch), width)}; expected (B, L, V)")
            # targets laid out like the logits: window position j predicts seq[a + j + 1]
            targets = torch.full((len(batch), width), -100, dtype=torch.long)
            for r, (i, a, b, f, g) in enumerate(batch):
                targets[r, f - a - 1:g - a - 1] = on_cpu[i][f:g]
            doc = torch.tensor([item[0] for item in batch]) if documents else None  # one id a window
            res = ev._update_rows(logits, targets.to(logits.device), document_ids=doc)
            if each is not None:
                each(batch, res)


@overload
def sliding_window_nll(model: Any, input_ids: Any, *, max_length: int, stride: Optional[int] = ...,
                       convention: str = ..., prefix_token: Optional[int] = ..., batch_size: int = ...,
                       num_threads: Optional[int] = ..., materialize: bool = ..., progress: bool = ...,
                       token_bytes: None = ...) -> torch.Tensor: ...
@overload
def sliding_window_nll(model: Any, input_ids: Any, *, max_length: int, stride: Optional[int] = ...,
                       convention: str = ..., prefix_token: Optional[int] = ..., batch_size: int = ...,
                       num_threads: Optional[int] = ..., materialize: bool = ..., progress: bool = ...,
                       token_bytes: TokenBytes) -> Tuple[torch.Tensor, Metrics]: ...


def sliding_window_nll(model: Any, input_ids: Any, *, max_length: int, stride: Optional[int] = None,
                       convention: str = "lm-eval", prefix_token: Optional[int] = None,
                       batch_size: int = 1, num_threads: Optional[int] = None,
                       materialize: bool = True, progress: bool = True,
                       token_bytes: Optional[TokenBytes] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, Metrics]]:
    """Per-token NLL (nats) of a long text scored by windows of at most
    ``max_length`` tokens.

    Entry ``i`` of the result is the NLL of ``input_ids[i]``, NaN where the
    convention does not score that token: ``nll.nansum()`` is the summed NLL,
    ``(~nll.isnan()).sum()`` the number of scored tokens, ``nll.nanmean()``
    the cross-entropy and its ``exp`` the perplexity. The model is called
    under ``torch.no_grad()``, ``batch_size`` windows at a time; only the last
    window can be shorter, and in a batch it is padded on the right, which a
    causal model's logits at the real positions do not see. The result does
    not depend on ``batch_size`` (beyond the model's own floating-point
    differences between batch shapes).

    Parameters
    ----------
    model : callable
        ``model(windows)`` takes a (B, L) tensor of token ids on
        ``input_ids``' device and returns logits (B, L, V), or an object with
        ``.logits`` (a transformers model).
    input_ids : torch.Tensor or array_like
        The text's token ids, 1-D or (1, T).
    max_length : int
        The longest window (the model's context).
    stride : int or None, default None
        Tokens between window starts; ``max_length`` when None.
    convention : {"lm-eval", "hf-guide", "max-context"}, default "lm-eval"
        With S the (prefixed) sequence and L = ``max_length``:

        ``"lm-eval"``: lm-evaluation-harness's ``loglikelihood_rolling`` token
        for token (``get_rolling_token_windows`` + ``make_disjoint_window``
        with ``prefix_token=S[0]`` and ``context_len=1``): the first window
        reads S[0:L] and scores S[1:L+1]; each later window scores the next
        ``stride`` tokens (a ``stride`` below L is lm-eval's ``context_len =
        L - stride + 1``) from a full window of L tokens ending just before
        its last target, so the last, partial window still gets L tokens of
        context. Every token of S after the first is scored once.

        ``"hf-guide"``: the transformers guide "Perplexity of fixed-length
        models", token for token: windows S[begin:end], begin = 0, stride,
        ..., end = min(begin + L, len(S)); labels before the previous
        window's end are -100, and the model's internal label shift drops
        each window's first label. Token 0 is never scored; with ``stride ==
        max_length`` neither is the first token of every later window (NaN
        here); with a smaller stride the token at the previous window's end is
        scored from L - stride tokens of context. The guide's own count
        subtracts one label per window for the shift, which with ``stride <
        max_length`` weighs its later windows slightly differently from
        ``exp(nll.nanmean())``.

        ``"max-context"``: windows S[b:b+L], b = 0, stride, ...; a window's
        last logits predict the token after it, and each token is scored by
        the first window that reaches it. Every token after S[0] is scored
        once.
    prefix_token : int or None, default None
        A token put before ``input_ids`` so that their first token is scored
        too (lm-eval uses the tokenizer's BOS, else EOS); without it
        ``input_ids[0]`` is context only (NaN).
    batch_size : int, default 1
        Windows per model call.
    num_threads : int or None, default None
        CPU threads for the metric (not the model).
    materialize : bool, default True
        False never holds a batch's (B, L, V) logits: ``model`` (a Hugging
        Face causal LM) runs its body, and its head is applied a bounded
        chunk of rows at a time (`lmmetrics.model_logits`, checked
        against the model's own forward on the first batch).
    progress : bool, default True
        A progress bar over the windows (tqdm, when installed, on a terminal
        only); False turns it off.
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]``, the UTF-8 bytes of token ``v`` (0 for special
        tokens; `lmmetrics.token_bytes`). Given, the windows' scored
        tokens also go through `lmmetrics.evaluate`'s sums in the same
        pass, and the result is ``(nll, metrics)``: ``metrics.bits_per_byte``
        is evaluate's (the scored tokens' float64 NLL over tokens with bytes,
        over ``ln 2`` times their bytes), with every other field of
        `lmmetrics.Metrics` over the scored tokens (``ignored``: the
        tokens of ``input_ids`` not scored).

    Returns
    -------
    torch.Tensor, or (torch.Tensor, Metrics) with ``token_bytes``
        Float, length T = ``len(input_ids)``, on the logits' device.

    Raises
    ------
    ValueError
        An unknown convention, ``max_length`` or ``stride`` out of range, ids
        that are not 1-D or (1, T) or are negative (labels' -100), a negative
        ``prefix_token``, an id (``prefix_token`` included) past the model's
        input embedding, or logits of the wrong shape.
    TypeError
        The model returned no logits tensor (a tuple, an array, a dict);
        ``input_ids`` that are not integers; a ``prefix_token`` that is not
        an integer (``True`` included: give the token id).

    Examples
    --------
    >>> import torch, lmmetrics
    >>> model = lambda ids: torch.zeros(*ids.shape, 16)          # uniform over 16 tokens
    >>> nll = lmmetrics.sliding_window_nll(model, torch.arange(10), max_length=4, prefix_token=0)
    >>> int((~nll.isnan()).sum()), round(float(nll.nanmean().exp()), 4)   # every token scored once
    (10, 16.0)
    >>> nll, m = lmmetrics.sliding_window_nll(model, torch.arange(10), max_length=4, prefix_token=0,
    ...                                       token_bytes=torch.full((16,), 2))
    >>> m.tokens, m.bytes, round(m.bits_per_byte, 6)              # 4 bits a token, 2 bytes a token
    (10, 20, 2.0)
    """
    import torch

    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (or (1, T)), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:  # no token (an empty list is float32 to torch): nothing to score
        ids = ids.long()
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {ids.dtype}")
    if ids.dtype not in (torch.int32, torch.int64):
        # an embedding takes int32 or int64 ids: not uint16 (nanoGPT's token files), int16 or uint8,
        # in which a prefix_token past the dtype's range would not fit either
        ids = ids.long()
    if ids.numel() and int(ids.min()) < 0:  # (a last id of -100, never read, scored 0)
        k = int((ids < 0).nonzero()[0, 0])
        raise ValueError(f"input_ids[{k}] is {int(ids[k])}: token ids are >= 0 (-100 is the ignore_index of "
                         f"labels: pass the ids the model reads, without padding)")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    max_length = check_positive_int("max_length", max_length)
    stride = max_length if stride is None else _check_stride(stride, max_length, "max_length")
    batch_size = check_positive_int("batch_size", batch_size)
    if max_length < 2 and convention != "lm-eval":
        raise ValueError("max_length must be at least 2 (a window scores tokens after its first)")
    if prefix_token is not None:
        prefix = torch.tensor([_token_id(prefix_token)], dtype=ids.dtype, device=ids.device)
        seq = torch.cat([prefix, ids])
    else:
        seq = ids
    shift = 0 if prefix_token is None else 1  # seq[k] is input_ids[k - shift]
    size = embedding_size(model)
    if size is not None and seq.numel() and int(seq.max()) >= size:
        k = int((seq >= size).nonzero()[0, 0])
        what = "prefix_token" if k < shift else f"input_ids[{k - shift}]"
        raise ValueError(f"{what} is {int(seq[k])}, but the model's input embedding holds {size} tokens "
                         f"(ids 0 to {size - 1}): the ids are not this model's")
    n, T = seq.shape[0], ids.shape[0]
    windows = [(0, a, b, f, g) for a, b, f, g in _WINDOWS[convention](n, max_length, stride)]
    # with token_bytes every metric, else the NLL alone (token_nll's pass)
    ev = Evaluator(token_bytes=token_bytes, nll_only=token_bytes is None, shift=False, num_threads=num_threads)
    made: List[torch.Tensor] = []  # the result, made once the first batch gives its dtype and device

    def scatter(batch: List[_Item], res: RowResults) -> None:
        per_pos = _per_position(res.floats("nll"), res)  # token_nll's values: a tensor, as the logits are one
        assert isinstance(per_pos, torch.Tensor)
        if not made:
            made.append(torch.full((T,), float("nan"), dtype=per_pos.dtype, device=per_pos.device))
        for r, (_, a, b, f, g) in enumerate(batch):
            made[0][f - shift:g - shift] = per_pos[r, f - a - 1:g - a - 1]

    score_windows(model, [seq], windows, ev, batch_size=batch_size, materialize=materialize, progress=progress,
                  documents=False, each=scatter, desc="sliding_window_nll")
    out = made[0] if made else torch.full((T,), float("nan"), dtype=torch.float32)
    if token_bytes is None:
        return out
    m = ev.compute()
    return out, replace(m, ignored=T - m.tokens)


def embedding_size(model: Any) -> Optional[int]:
    """The number of token ids the model's input embedding holds
    (``get_input_embeddings().num_embeddings``), None where it has none to
    read."""
    embeddings = getattr(model, "get_input_embeddings", None)
    try:
        layer = embeddings() if callable(embeddings) else None
    except NotImplementedError:  # (transformers' default for a model whose embedding it cannot find: not checked)
        return None
    size = getattr(layer, "num_embeddings", None)
    return size if isinstance(size, int) else None


def _token_id(token: Any) -> int:
    """prefix_token as a token id: an integer >= 0 (True is not token 1,
    nor 1.7 token 1)."""
    if isinstance(token, (bool, np.bool_)):
        raise TypeError(f"prefix_token must be a token id, got {token!r}: pass the id itself, e.g. "
                        f"prefix_token=tokenizer.bos_token_id")
    return check_token_id("prefix_token", token)


def _returned_logits(res: Any) -> torch.Tensor:
    """The logits tensor a model returned: a tensor, or an output whose
    ``.logits`` is one; anything else a TypeError naming what came back."""
    import torch

    logits = getattr(res, "logits", res)
    if isinstance(logits, torch.Tensor):
        return logits
    kind = type(res).__qualname__ if type(res).__module__ == "builtins" else \
        f"{type(res).__module__}.{type(res).__qualname__}"
    what = f"an output whose .logits is {logits!r:.40}" if logits is not res else f"a {kind}"
    raise TypeError(f"model(windows) returned {what}; it must return a torch.Tensor of logits (B, L, V) "
                    f"or an object with such a .logits (wrap the model, e.g. lambda x: model(x)[0], "
                    f"or call it with return_dict=True)")


def _progress_bar(total: int, progress: bool, desc: str) -> Any:
    """A tqdm bar over ``total`` windows (shown on a terminal only), or None
    without tqdm or with progress=False."""
    if not progress or total < 2:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="window", desc=desc, disable=None, leave=False)
