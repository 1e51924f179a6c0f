"""The metrics of text: a Hugging Face causal LM and its tokenizer in, the
`lmmetrics.Metrics` of the text out (bits per byte included), the
model's head applied lazily (`lmmetrics.model_logits`), long texts by
the windows of `lmmetrics.sliding_window_nll`."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._engine.checks import check_positive_int, check_token_id
from .evaluation import Evaluator, Metrics
from .tokens import _is_tokenizers
from .tokens import token_bytes as _token_bytes
from .windows import _check_stride, _Item, _lm_eval_windows, embedding_size, score_windows

if TYPE_CHECKING:
    import torch


def text_metrics(model: Any, tokenizer: Any, text: Union[str, Sequence[str]], *, window: Optional[int] = None,
                 stride: Optional[int] = None, batch_size: int = 8, bos: Union[bool, int] = True,
                 token_bytes: Any = None, num_threads: Optional[int] = None, progress: bool = True) -> Metrics:
    """Every metric of a text (or of each of several) under a Hugging Face
    causal LM: perplexity, bits per byte, accuracy, entropy and their
    standard errors, from one forward pass a window.

    Each text is encoded without the tokenizer's special tokens
    (``add_special_tokens=False``); ``bos`` decides what comes before it.
    The model runs under ``torch.no_grad()`` up to its output head, and the
    head is applied a bounded chunk of rows at a time
    (`lmmetrics.model_logits`, checked against the model's own forward
    on the first batch): a text's (T, V) logits are never held.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM (``...ForCausalLM``) in eval mode, whose forward calls
        its output head.
    tokenizer : transformers tokenizer or tokenizers.Tokenizer
        The model's tokenizer.
    text : str or sequence of str
        A text, or several: several are each a document (``document_ids``
        of `lmmetrics.evaluate`), which adds the ``macro_*`` means,
        ``mean_perplexity`` (Hugging Face ``evaluate``'s), the standard
        errors by document and ``per_document`` (in the order of the texts:
        id ``i`` is ``text[i]``).
    window : int or None, default None
        None: each text in one forward pass (it must fit the model's
        context, ``config.max_position_embeddings``). An int: texts longer
        than that are read in windows of at most ``window`` tokens as
        `lmmetrics.sliding_window_nll` reads them by default
        (lm-evaluation-harness's rolling windows: every token is scored
        once; each window after the first scores the next ``stride`` tokens
        with a full window of context).
    stride : int or None, default None
        With ``window``: the tokens each later window scores, at most
        ``window`` (``window`` when None).
    batch_size : int, default 8
        Texts (or windows) per forward pass; a batch's shorter ones are
        padded on the right, which a causal model's other positions do not
        see.
    bos : bool or int, default True
        ``True``: put the tokenizer's BOS token (``bos_token_id``) before
        each text, so that its first token is scored too (from BOS alone),
        as lm-evaluation-harness's rolling log-likelihood, Hugging Face
        ``evaluate``'s perplexity (``add_start_token=True``) and nanochat
        (whose documents start with BOS) do; every byte of the text is
        then in the bits per byte. A ValueError when the tokenizer has no
        BOS token. ``False``: nothing before the text, whose first token is
        context only and not scored (the transformers perplexity guide's
        convention): one token fewer per text, and its bytes leave the bits
        per byte. An int: that token id before each text (lm-eval puts EOS
        where there is no BOS: ``bos=tokenizer.eos_token_id``).
    token_bytes : array_like, torch.Tensor or None, default None
        ``token_bytes[v]``, the UTF-8 bytes of token ``v``, one entry per
        column of the logits; None: `lmmetrics.token_bytes` of the
        tokenizer, padded to the model's vocabulary. Bits per byte is
        nanochat's: the scored tokens' NLL over ``ln 2`` times their bytes.
        For a byte-level or byte-fallback tokenizer the bytes of a text's
        tokens add up to the UTF-8 length of the text (a SentencePiece
        dummy prefix or a byte-level ``add_prefix_space=True`` adds one
        byte, a normalizer may change the count, and a special token's
        text written in the text, ``"<s>"``, which the tokenizer reads as
        that token, counts 0 bytes), so
        with ``bos=True`` it is lm-eval's ``bits_per_byte`` (the text's
        summed NLL over ``ln 2`` times its UTF-8 length). Without byte
        fallback, text the vocabulary has no piece for is the unknown
        token, 0 bytes, its NLL left out too: ``Metrics.bytes`` is then
        less than the text's UTF-8 length.
    num_threads : int or None, default None
        CPU threads for the metrics (not the model).
    progress : bool, default True
        A progress bar over the forward passes (tqdm, on a terminal only).

    Returns
    -------
    Metrics
        Over every scored token of the texts; ``ignored`` is the number of
        the texts' tokens not scored (with ``bos=False``, the first of each).

    Raises
    ------
    ValueError
        ``bos=True`` with a tokenizer without a BOS token; a text with no
        token to score (empty, or one token with ``bos=False``); a text (or
        ``window``) longer than the model's context; a token id (the BOS
        included) past the model's input embedding (a tokenizer of another
        model); ``stride`` without ``window`` or above it; the model in
        training mode with dropout.
    TypeError
        ``text`` not a str or a sequence of str; a model without an output
        head; a tokenizer `lmmetrics.token_bytes` does not read (pass
        ``token_bytes``).

    Examples
    --------
    >>> import torch, lmmetrics
    >>> from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    >>> from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    >>> raw = Tokenizer(models.BPE())
    >>> raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    >>> raw.train_from_iterator(["the cat sat on the mat. " * 20], trainers.BpeTrainer(vocab_size=280,
    ...     special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>")
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=1, num_attention_heads=4)).eval()
    >>> m = lmmetrics.text_metrics(model, tokenizer, ["the cat sat.", "on the mat."])
    >>> m.bytes, m.documents              # every byte of both texts: BOS scores their first tokens
    (23, 2)
    >>> round(m.mean_perplexity, 1), round(m.macro_perplexity, 1)   # arithmetic and geometric means
    (314.5, 314.3)
    """
    import torch

    texts, several = _texts(text)
    window = None if window is None else check_positive_int("window", window)
    if stride is not None:
        if window is None:
            raise ValueError("stride needs window: it is the step between windows of a long text")
        stride = _check_stride(stride, window, "window")
    batch_size = check_positive_int("batch_size", batch_size)
    prefix = _bos_id(tokenizer, bos)
    device = _device(model)
    ids = [_encode(tokenizer, t) for t in texts]
    sequences = [torch.tensor(([] if prefix is None else [prefix]) + x, dtype=torch.long, device=device)
                 for x in ids]
    items: List[_Item] = []
    for i, seq in enumerate(sequences):
        n = int(seq.shape[0])
        if n < 2:
            raise ValueError(f"text {i} ({texts[i][:40]!r}) has no token to score: it encodes to {len(ids[i])} "
                             f"token(s){', and bos=False scores from the second on' if prefix is None else ''}")
        # one window reading the whole text but its last token, or lm-eval's rolling windows
        w = n - 1 if window is None else window
        items += [(i, a, b, f, g) for a, b, f, g in _lm_eval_windows(n, w, w if stride is None else stride)]
    _check_context(model, max(b - a for _, a, b, _, _ in items), window)
    _check_ids(model, sequences)
    if token_bytes is None:
        token_bytes = _table(tokenizer, model)
    ev = Evaluator(token_bytes=token_bytes, shift=False, num_threads=num_threads)
    score_windows(model, sequences, items, ev, batch_size=batch_size, materialize=False, progress=progress,
                  documents=several, desc="text_metrics")
    m = ev.compute()
    return replace(m, ignored=sum(len(x) for x in ids) - m.tokens)


def _texts(text: Any) -> Tuple[List[str], bool]:
    """The texts, and whether several were given (a sequence, even of one)."""
    if isinstance(text, str):
        return [text], False
    if isinstance(text, (bytes, bytearray)):
        raise TypeError("text must be a str or a sequence of str, got bytes: decode it first")
    try:
        texts = list(text)
    except TypeError:
        raise TypeError(f"text must be a str or a sequence of str, got {type(text).__name__}") from None
    bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
    if bad:
        raise TypeError(f"text must be a str or a sequence of str; the sequence holds a {bad[0]}")
    if not texts:
        raise ValueError("text is an empty sequence: give at least one text")
    return texts, True


def _bos_id(tokenizer: Any, bos: Union[bool, int]) -> Optional[int]:
    """The token id put before each text (None for bos=False)."""
    if isinstance(bos, (bool, np.bool_)):
        if not bos:
            return None
        found = getattr(tokenizer, "bos_token_id", None)
        if found is None:
            raise ValueError(
                f"bos=True, but the tokenizer ({type(tokenizer).__name__}) has no BOS token (bos_token_id is "
                f"None): pass bos=False to score each text from its second token on (the first is context "
                f"only, as in the transformers perplexity guide), or the token id to put before each text, "
                f"e.g. bos=tokenizer.eos_token_id (lm-eval's prefix where there is no BOS)")
        return int(found)
    return check_token_id("bos", bos, "True, False or a token id")


def _encode(tokenizer: Any, text: str) -> List[int]:
    """The text's token ids, without the tokenizer's special tokens."""
    if _is_tokenizers(tokenizer):  # a tokenizers.Tokenizer
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    if callable(tokenizer):  # a transformers tokenizer
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    raise TypeError(f"tokenizer must be a transformers tokenizer or a tokenizers.Tokenizer, got "
                    f"{type(tokenizer).__name__}")


def _device(model: Any) -> torch.device:
    """Where the model's ids go: the device of its output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None:
        raise TypeError(f"text_metrics: {type(model).__name__} has no output head (get_output_embeddings()): "
                        f"pass a causal LM (...ForCausalLM)")
    device: torch.device = getattr(model, "device", weight.device)
    return device


def _check_context(model: Any, longest: int, window: Optional[int]) -> None:
    """A ValueError when a forward pass would read more tokens than the
    model's config says it takes."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and longest > context:
        if window is None:
            raise ValueError(f"a text needs a forward pass over {longest} tokens, more than the model's context "
                             f"({context}, config.max_position_embeddings): give window= (at most {context}) to "
                             f"read it in windows")
        raise ValueError(f"window ({window}) is longer than the model's context ({context}, "
                         f"config.max_position_embeddings)")


def _check_ids(model: Any, sequences: Sequence[Any]) -> None:
    """A ValueError when a text's token ids (the BOS included) reach past
    the model's input embedding: a tokenizer of another model (torch's
    embedding said only "index out of range in self")."""
    size = embedding_size(model)
    if size is None:
        return
    for i, seq in enumerate(sequences):
        top = int(seq.max())
        if top >= size:
            raise ValueError(f"text {i} encodes to token id {top}, but the model's input embedding holds {size} "
                             f"tokens (ids 0 to {size - 1}): the tokenizer is not this model's")


def _table(tokenizer: Any, model: Any) -> Any:
    """lmmetrics.token_bytes of the tokenizer, as wide as the model's logits."""
    width = int(model.get_output_embeddings().weight.shape[0])
    try:
        table = _token_bytes(tokenizer)
    except TypeError as e:
        raise TypeError(f"{e}; or pass text_metrics(..., token_bytes=table), the bytes of each token id") from None
    # ids past the model's vocabulary are not in the table: as targets they are refused, with the id named
    return np.concatenate([table[:width], np.zeros(max(width - table.shape[0], 0), np.int64)])
