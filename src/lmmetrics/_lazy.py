"""Lazy logits: ``scale * (hidden @ weight.T + bias)`` (optionally
soft-capped) standing in for the ``N x V`` logits, computed a bounded chunk
of rows at a time by the engine (:func:`lmmetrics._engine.run`) and never
held whole.

:class:`Projected` only describes the product and materializes chosen rows
on request (:meth:`Projected.rows`): numpy hidden states with numpy's BLAS,
torch tensors with torch's matmul on their device. :func:`model_logits`
builds one from a Hugging Face causal LM and checks it against the model's
own forward before it is used.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from ._checks import check_positive_int, check_softcap
from ._device import to_device

if TYPE_CHECKING:
    import torch

# Logits rows materialized at once (per side) on the host: a few tens of MiB
DEFAULT_CHUNK_BYTES = 32 * 2**20


def _is_torch(x: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


class Projected:
    """Logits ``scale * (hidden @ weight.T + bias)``, soft-capped to
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is set, that are
    never computed whole. Build one with :func:`lmmetrics.projected`."""

    def __init__(self, hidden: Any, weight: Any, bias: Any = None, scale: float = 1.0,
                 softcap: Optional[float] = None, chunk_bytes: Optional[int] = None) -> None:
        torch_in = [_is_torch(x) for x in (hidden, weight, bias) if x is not None]
        if any(torch_in) and not all(torch_in):
            raise TypeError("projected: hidden, weight and bias must all be torch tensors or all numpy arrays")
        if not torch_in[0]:
            hidden, weight = np.asarray(hidden), np.asarray(weight)
            bias = None if bias is None else np.asarray(bias)
            for name, x in (("hidden", hidden), ("weight", weight), ("bias", bias)):
                if x is not None and x.dtype not in (np.float32, np.float64):
                    raise TypeError(f"projected: numpy {name} must be float32 or float64, got {x.dtype} "
                                    f"(pass torch tensors for 16-bit weights)")
        else:
            hidden, weight = hidden.detach(), weight.detach()
            bias = None if bias is None else bias.detach()
            if any(x.dtype != hidden.dtype for x in (weight, bias) if x is not None):
                raise TypeError(f"projected: hidden ({hidden.dtype}), weight ({weight.dtype})"
                                f"{'' if bias is None else f' and bias ({bias.dtype})'} must share one dtype "
                                f"for torch's matmul")
            if not hidden.is_floating_point() or hidden.dtype not in _TORCH_FLOATS():
                raise TypeError(f"projected: hidden must be float32, float64, float16 or bfloat16, "
                                f"got {hidden.dtype}")
            if any(x.device != hidden.device for x in (weight, bias) if x is not None):
                raise ValueError(f"projected: hidden is on {hidden.device} but the weight (or bias) is on "
                                 f"{weight.device if weight.device != hidden.device else bias.device}; "
                                 f"put them on one device")
        if hidden.ndim < 1:
            raise ValueError("projected: hidden must be (..., d), got a scalar")
        if weight.ndim != 2:
            raise ValueError(f"projected: weight must be (V, d), got shape {tuple(weight.shape)}")
        if weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"projected: hidden size {hidden.shape[-1]} (hidden shape {tuple(hidden.shape)}) "
                             f"does not match the weight's {weight.shape[1]} (weight shape "
                             f"{tuple(weight.shape)}, expected (V, {hidden.shape[-1]}))")
        if weight.shape[0] == 0:
            raise ValueError("projected: the weight has an empty vocabulary (shape (0, d))")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"projected: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        try:
            scale_f = float(scale)
        except (TypeError, ValueError):
            scale_f = math.nan
        if not math.isfinite(scale_f) or scale_f == 0:
            raise ValueError(f"projected: scale must be a finite non-zero number, got {scale!r}")
        self.hidden: Any = hidden
        self.weight: Any = weight
        self.bias: Any = bias
        self.scale: float = scale_f
        self.softcap: Optional[float] = check_softcap(softcap) or None
        self.chunk_bytes: Optional[int] = None if chunk_bytes is None else check_positive_int("chunk_bytes",
                                                                                              chunk_bytes)
        self.is_torch: bool = bool(torch_in[0])
        self.from_model = False  # model_logits(): shift must be said

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape of the logits this stands for: hidden's without d, then V."""
        return tuple(int(n) for n in self.hidden.shape[:-1]) + (int(self.weight.shape[0]),)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> str:
        """The logits' dtype name: the matmul's result dtype."""
        if self.is_torch:
            return _dtype_name(self.hidden)
        return str(np.result_type(self.hidden, self.weight))

    @property
    def device(self) -> Any:
        """The torch device of the tensors, or None for numpy."""
        return self.hidden.device if self.is_torch else None

    @property
    def itemsize(self) -> int:
        return int(self.hidden.element_size()) if self.is_torch else np.dtype(self.dtype).itemsize

    def __repr__(self) -> str:
        extra = "".join([", bias" if self.bias is not None else "",
                         f", scale={self.scale:g}" if self.scale != 1.0 else "",
                         f", softcap={self.softcap:g}" if self.softcap else ""])
        return f"projected(logits shape {self.shape}, {self.dtype}{extra})"

    def drop_last_position(self) -> Projected:
        """The same head over hidden[..., :-1, :] (next-token alignment)."""
        if self.hidden.ndim < 2:
            raise ValueError(f"shift=True needs hidden states with a time axis (..., T, d), got shape "
                             f"{tuple(self.hidden.shape)}")
        new = Projected.__new__(Projected)
        new.__dict__.update(self.__dict__)
        new.hidden = self.hidden[..., :-1, :]
        return new

    def rows(self, index: Any, cols: slice = slice(None), softcap: float = 0.0) -> Any:
        """The logits (len(index), columns) of the rows ``index`` (flat row
        numbers, a numpy int64 array) in the vocabulary columns ``cols``,
        computed now: the only place logits exist. ``softcap`` caps them
        further (a metric's own softcap, applied here when the engine splits
        the vocabulary)."""
        lead = self.shape[:-1]
        w = self.weight[cols]
        b = None if self.bias is None else self.bias[cols]
        caps = [c for c in (self.softcap, softcap or None) if c]
        if self.is_torch:
            import torch

            if len(lead) <= 1:
                sel = to_device(index, self.hidden.device)
                h = self.hidden.reshape(-1, self.hidden.shape[-1]).index_select(0, sel)
            else:
                h = self.hidden[tuple(to_device(k, self.hidden.device) for k in np.unravel_index(index, lead))]
            z = torch.nn.functional.linear(h, w, b)
            if self.scale != 1.0:
                z.mul_(self.scale)
            for c in caps:
                z = torch.tanh(z.div_(c)).mul_(c)
            return z
        h = self.hidden.reshape(-1, self.hidden.shape[-1])[index] if len(lead) <= 1 else \
            self.hidden[np.unravel_index(index, lead)]
        z = h @ w.T
        if b is not None:
            z += b
        if self.scale != 1.0:
            z *= self.scale
        for c in caps:
            z /= c
            np.tanh(z, out=z)
            z *= c
        return z


def _TORCH_FLOATS() -> Tuple[Any, ...]:
    import torch

    return (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def projected(hidden: Any, weight: Any, bias: Any = None, scale: float = 1.0, softcap: Optional[float] = None,
              *, chunk_bytes: Optional[int] = None) -> Projected:
    """Lazy logits ``scale * (hidden @ weight.T + bias)``: pass them wherever
    logits go, and no ``N x V`` logits are ever held.

    Parameters
    ----------
    hidden : array or tensor (..., d)
        The hidden states that enter the output head (after the model's
        final norm): numpy float32 / float64, or torch tensors (CPU or CUDA,
        any float dtype).
    weight : array or tensor (V, d)
        The head's weight (``lm_head.weight``, or the tied embeddings).
    bias : array or tensor (V,), optional
        The head's bias.
    scale : float
        A factor on the logits (Cohere's ``logit_scale``).
    softcap : float, optional
        ``softcap * tanh(logits / softcap)`` after the scale (Gemma 2/3's
        ``final_logit_softcapping``).
    chunk_bytes : int, optional
        The most logits bytes computed at once per side (default 32 MiB for
        host arrays, the CUDA chunk setting for CUDA tensors).

    Returns
    -------
    Projected
        Logits that every metric, :func:`lmmetrics.evaluate`,
        :class:`lmmetrics.Evaluator`, :func:`lmmetrics.compare` and
        :func:`lmmetrics.loglikelihood` take, also as ``reference_logits``.

    Examples
    --------
    >>> import numpy as np, lmmetrics
    >>> rng = np.random.default_rng(0)
    >>> hidden = rng.standard_normal((2, 16, 32), dtype=np.float32)
    >>> weight = rng.standard_normal((1000, 32), dtype=np.float32) * 0.1
    >>> ids = rng.integers(0, 1000, (2, 16))
    >>> lazy = lmmetrics.projected(hidden, weight)
    >>> ppl = lmmetrics.perplexity(lazy, ids, shift=True)
    >>> bool(np.isclose(ppl, lmmetrics.perplexity(hidden @ weight.T, ids, shift=True)))
    True
    """
    return Projected(hidden, weight, bias, scale, softcap, chunk_bytes)


# ------------------------------------------------------------ from a model

def _config_value(model: Any, name: str) -> Any:
    config = getattr(model, "config", None)
    value = getattr(config, name, None)
    if value is None and config is not None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    return value


def model_logits(model: Any, input_ids: Any, attention_mask: Any = None, *, check: bool = True,
                 check_positions: int = 8, chunk_bytes: Optional[int] = None) -> Projected:
    """Lazy logits of a Hugging Face causal LM on ``input_ids``: the model's
    body runs once, the head is applied a chunk of rows at a time by the
    metric that reads them.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM with an output head (``get_output_embeddings()``) and a
        body (``get_decoder()`` or ``base_model``).
    input_ids : torch.Tensor (B, T)
        Token ids, on the model's device.
    attention_mask : torch.Tensor (B, T), optional
        As the model takes it.
    check : bool
        Compare these logits with the model's own forward on the first
        ``check_positions`` attended positions of the first sequence before
        returning (default): a model whose head this function does not
        understand is an error, never a wrong number.
    check_positions : int
        How many positions the check compares.
    chunk_bytes : int, optional
        As :func:`projected`'s.

    Returns
    -------
    Projected
        The model's logits, lazily: ``hidden @ W.T (+ bias)``, times
        ``config.logit_scale`` (Cohere), soft-capped by
        ``config.final_logit_softcapping`` (Gemma 2/3).

    Raises
    ------
    TypeError
        The model has no output head or body this function can find.
    ValueError
        The lazy logits disagree with the model's own logits (an
        architecture with an output transform this function does not know).

    Examples
    --------
    >>> import torch, lmmetrics
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=1, num_attention_heads=4)).eval()
    >>> ids = torch.randint(0, 500, (2, 12))
    >>> with torch.no_grad():
    ...     lazy = lmmetrics.model_logits(model, ids)
    ...     full = model(ids).logits
    >>> abs(lmmetrics.perplexity(lazy, ids, shift=True) - lmmetrics.perplexity(full, ids, shift=True)) < 1e-3
    True
    """
    import torch

    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"model_logits: {name} has no output head with a 2-D weight "
                        f"(get_output_embeddings() gave {type(head).__name__}): pass a causal LM "
                        f"(...ForCausalLM), or build the logits with lmmetrics.projected(hidden, weight)")
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None or body is model:
        body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise TypeError(f"model_logits: {name} has no body to run apart from its head "
                        f"(get_decoder() / base_model)")
    bias = getattr(head, "bias", None)
    scale = _config_value(model, "logit_scale")
    softcap = _config_value(model, "final_logit_softcapping")
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    with torch.no_grad():
        out = body(input_ids=ids, attention_mask=attention_mask)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    lazy = Projected(hidden, weight, bias if isinstance(bias, torch.Tensor) else None,
                     1.0 if scale is None else float(scale), softcap, chunk_bytes)
    lazy.from_model = True
    if check:
        _check_against_forward(model, name, lazy, ids, attention_mask, check_positive_int(
            "check_positions", check_positions))
    return lazy


def _check_against_forward(model: Any, name: str, lazy: Projected, ids: torch.Tensor, attention_mask: Any,
                           k: int) -> None:
    """The lazy logits of the first sequence's first k attended positions
    against the model's own forward on that prefix."""
    import torch

    mask = None if attention_mask is None else torch.as_tensor(attention_mask)[:1]
    first = 0 if mask is None or not bool(mask.any()) else int(torch.nonzero(mask[0])[0, 0])
    end = min(ids.shape[1], first + k)
    if end <= first:
        return
    with torch.no_grad():
        want = model(input_ids=ids[:1, :end], attention_mask=None if mask is None else mask[:, :end]).logits
    want = want[0, first:end].double()
    got = lazy.rows(np.arange(first, end, dtype=np.int64)).double()
    tol = (1e-4 if lazy.hidden.dtype in (torch.float32, torch.float64) else 3e-2) * (1.0 + float(want.abs().max()))
    err = float((got - want).abs().max())
    if not err <= tol:
        raise ValueError(
            f"model_logits: the logits built from {name}'s body and head differ from the model's own "
            f"by up to {err:.3g} (tolerance {tol:.3g}) on its first positions: this architecture transforms "
            f"its logits in a way lmmetrics does not know. Use model(input_ids).logits, or build them with "
            f"lmmetrics.projected(hidden, weight, bias, scale, softcap)")
