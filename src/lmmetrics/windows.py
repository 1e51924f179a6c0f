"""Strided (sliding-window) evaluation of a long token sequence with a model
of fixed context length, as in the transformers guide "Perplexity of
fixed-length models"."""
from __future__ import annotations

from typing import Any, Optional

from .metrics import token_nll


def sliding_window_nll(model: Any, input_ids: Any, *, max_length: int, stride: int,
                       num_threads: Optional[int] = None):
    """Per-token NLL of ``input_ids`` (nats), each token scored once.

    Windows of at most ``max_length`` tokens start every ``stride`` tokens.
    A window ``ids[b:e]`` predicts tokens b + 1 .. e (its last logits
    predict the token after it); each window scores only the tokens no
    earlier window did, so every token after the first is scored exactly
    once, by the first window that can, which gives it the longest context.
    ``stride == max_length`` is disjoint chunks (inputs ``ids[b:b+L]``,
    targets ``ids[b+1:b+L+1]``); a smaller stride gives more context at more
    cost.

    ``model(window)`` takes a (1, L) tensor of token ids and returns logits
    (1, L, V), or an object with ``.logits``. ``input_ids`` is a 1-D tensor
    (or (1, T)). Returns a tensor of length T - 1 whose entry i is the NLL of
    token i + 1, on the device of the logits: ``nll.mean()`` is the
    cross-entropy, ``exp`` of it the perplexity.
    """
    import torch

    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (or (1, T)), got shape {tuple(ids.shape)}")
    for name, v in (("max_length", max_length), ("stride", stride)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if max_length < 2:
        raise ValueError("max_length must be at least 2 (a window scores tokens after its first)")
    if stride > max_length:
        raise ValueError(f"stride ({stride}) must not exceed max_length ({max_length}): "
                         f"tokens between windows would not be scored")
    n = ids.shape[0]
    parts = []
    next_tok = 1  # the first token not yet scored
    with torch.no_grad():
        for begin in range(0, max(n - 1, 0), stride):
            end = min(begin + max_length, n)
            first, last = max(next_tok, begin + 1), min(end, n - 1)  # tokens to score
            if first > last:
                continue
            out = model(ids[begin:end].unsqueeze(0))
            logits = getattr(out, "logits", out)
            # token k is predicted by the logits at window position k - begin - 1
            rows = logits[0, first - begin - 1:last - begin]
            parts.append(token_nll(rows, ids[first:last + 1].to(rows.device), num_threads=num_threads))
            next_tok = last + 1
            if next_tok == n:
                break
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)
