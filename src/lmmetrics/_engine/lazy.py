"""Lazy logits: ``scale * (hidden @ weight.T + bias)`` (optionally
soft-capped) standing in for the ``N x V`` logits, computed a bounded chunk
of rows at a time by the engine (`lmmetrics._engine.run`) and never
held whole.

`Projected` only describes the product and materializes chosen rows
on request (`Projected.rows`): numpy hidden states with numpy's BLAS,
torch tensors with torch's matmul on their device. `model_logits`
builds one from a Hugging Face causal LM and checks it against the model's
own forward before it is used.
"""
from __future__ import annotations

import math
import numbers
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import numpy as np

from .checks import check_positive_int, check_softcap
from .device import is_torch, to_device

if TYPE_CHECKING:
    import torch

# Logits rows materialized at once (per side) on the host: a few tens of MiB
DEFAULT_CHUNK_BYTES = 32 * 2**20

# A factor on a head's output: its value, and whether the logits are
# divided by it (else multiplied)
_Factor = Tuple[float, bool]
_NO_FACTOR: _Factor = (1.0, False)
# What model_logits' check finds: the factor, the soft cap, the logits'
# dtype where the model changes it after the head (None: the head's)
_Transform = Tuple[_Factor, Optional[float], Any]


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


class Projected:
    """Logits ``scale * (hidden @ weight.T + bias)``, soft-capped to
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is set, that are
    never computed whole. Build one with `lmmetrics.projected`.
    ``divisor`` is set (``model_logits`` of a model that divides its logits
    by a factor, as Granite does) where the logits are divided by it, as the
    model does; ``scale`` is then its inverse."""

    def __init__(self, hidden: Any, weight: Any, bias: Any = None, scale: float = 1.0,
                 softcap: Optional[float] = None, chunk_bytes: Optional[int] = None,
                 _autocast: Any = None, _out_dtype: Any = None, _divide: bool = False) -> None:
        torch_in = [is_torch(x) for x in (hidden, weight, bias) if x is not None]
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
            if _autocast is None and any(x.dtype != hidden.dtype for x in (weight, bias) if x is not None):
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
        if weight.shape[1] == 0:
            raise ValueError(f"projected: hidden size 0 (hidden shape {tuple(hidden.shape)}, weight shape "
                             f"{tuple(weight.shape)}): the hidden states and the head need at least one feature")
        given: object = scale  # (any object: a bool or a string is refused, not read as a number)
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            raise TypeError(f"projected: scale must be a real number (a float), got {scale!r}")
        scale_f = float(given)
        if not math.isfinite(scale_f) or scale_f == 0:
            raise ValueError(f"projected: scale must be a finite non-zero number, got {scale!r}")
        self.hidden: Any = hidden
        self.weight: Any = weight
        self.bias: Any = bias
        # model_logits(): a model that divides its logits by a factor
        # (Granite) is divided by it, to the bit, not multiplied by its
        # inverse (which rounds 1% of 16-bit logits differently)
        self.divisor: Optional[float] = scale_f if _divide else None
        self.scale: float = 1.0 / scale_f if _divide else scale_f
        self.softcap: Optional[float] = check_softcap(softcap) or None
        self.chunk_bytes: Optional[int] = None if chunk_bytes is None else check_positive_int("chunk_bytes",
                                                                                              chunk_bytes)
        self.is_torch: bool = bool(torch_in[0])
        self.from_model = False  # model_logits(): shift must be said
        # model_logits(): the autocast (device type, dtype) the model's head
        # ran under, and its logits' dtype when the model changes it after
        # the head (Beam, Mamba: .float()); None: the head's own
        self.autocast: Optional[Tuple[str, Any]] = _autocast
        self.out_dtype: Any = _out_dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape of the logits this stands for: hidden's without d, then V."""
        return tuple(int(n) for n in self.hidden.shape[:-1]) + (int(self.weight.shape[0]),)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _torch_dtype(self) -> Any:
        if self.out_dtype is not None:
            return self.out_dtype
        return self.autocast[1] if self.autocast else self.hidden.dtype

    @property
    def dtype(self) -> str:
        """The logits' dtype name: the matmul's result dtype (or the model's
        logits' for `model_logits`)."""
        if self.is_torch:
            return str(self._torch_dtype()).replace("torch.", "")
        return str(np.result_type(self.hidden, self.weight))

    @property
    def device(self) -> Any:
        """The torch device of the tensors, or None for numpy."""
        return self.hidden.device if self.is_torch else None

    @property
    def itemsize(self) -> int:
        if self.is_torch:
            import torch

            return int(torch.finfo(self._torch_dtype()).bits // 8)
        return np.dtype(self.dtype).itemsize

    def __repr__(self) -> str:
        extra = "".join([", bias" if self.bias is not None else "",
                         f", scale=1/{self.divisor:g}" if self.divisor is not None else
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
        the vocabulary: in float32, float64 for float64 logits, as the
        metric caps whole rows)."""
        z = self._rows(index, cols)
        if not softcap:
            return z
        if self.is_torch:
            import torch

            z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
            return torch.tanh(z.div_(softcap)).mul_(softcap)
        z /= softcap
        np.tanh(z, out=z)
        z *= softcap
        return z

    def _factor(self) -> _Factor:
        """The factor on the head's output, and whether it divides."""
        return (self.divisor, True) if self.divisor is not None else (self.scale, False)

    def _rows(self, index: Any, cols: slice) -> Any:
        lead = self.shape[:-1]
        w = self.weight[cols]
        b = None if self.bias is None else self.bias[cols]
        caps = [self.softcap] if self.softcap else []
        if self.is_torch:
            import torch

            if len(lead) <= 1:
                sel = to_device(index, self.hidden.device)
                h = self.hidden.reshape(-1, self.hidden.shape[-1]).index_select(0, sel)
            else:
                h = self.hidden[tuple(to_device(k, self.hidden.device) for k in np.unravel_index(index, lead))]
            dev = h.device.type
            with torch.autocast(dev, dtype=self.autocast[1] if self.autocast else None, enabled=bool(self.autocast)):
                z = torch.nn.functional.linear(h, w, b)
            return _finish(z, self.out_dtype, self._factor(), caps)
        h = self.hidden.reshape(-1, self.hidden.shape[-1])[index] if len(lead) <= 1 else \
            self.hidden[np.unravel_index(index, lead)]
        with np.errstate(invalid="ignore", over="ignore"):  # (NaN and overflow: the metric's to name)
            z = h @ w.T
            if b is not None:
                z += b
            if self.divisor is not None:
                z /= self.divisor
            elif self.scale != 1.0:
                z *= self.scale
            for c in caps:
                z /= c
                np.tanh(z, out=z)
                z *= c
        return z


def _finish(z: torch.Tensor, out_dtype: Any, factor: _Factor, caps: List[float]) -> torch.Tensor:
    """The head's output z (a fresh tensor) made logits: in out_dtype (the
    model's logits' dtype; None: z's), times the factor or divided by it
    (factor: the value, and whether it divides), as torch's operation on a
    Python number in z's dtype, as the model applies it; soft-capped by
    each cap (the order of the models' own code: Gemma 2, Cohere, Beam's
    .float() first)."""
    import torch

    if out_dtype is not None and z.dtype != out_dtype:
        z = z.to(out_dtype)
    value, divide = factor
    if divide:
        z.div_(value)
    elif value != 1.0:
        z.mul_(value)
    for c in caps:
        z = torch.tanh(z.div_(c)).mul_(c)
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
        Logits that every metric, `lmmetrics.evaluate`,
        `lmmetrics.Evaluator`, `lmmetrics.compare` and
        `lmmetrics.loglikelihood` take, also as ``reference_logits``.

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

# Config attributes of the transforms causal LMs apply to their head's
# output: factors (in the logits' dtype, logits * s or logits / s: both
# conventions exist, under one name too: transformers' Granite divides by
# logits_scaling, HyperCLOVAX multiplies by it; Cohere multiplies by
# logit_scale, Falcon-H1 by lm_head_multiplier, MuseSpark by
# output_multiplier) and soft caps. Which of them the model applies
# is decided by the model's own forward (the check), never by the name alone.
_FACTORS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
# The probe's magnitudes: a head output spanning these shows any elementwise
# transform of the model's (a factor at every value, a soft cap at the large
# ones, an offset at the small ones).
_PROBE_AMPLITUDES = (0.01, 0.3, 2.0, 8.0, 30.0, 120.0, 1000.0)


def _config_value(model: Any, name: str) -> Any:
    config = getattr(model, "config", None)
    value = getattr(config, name, None)
    if value is None and config is not None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    return value


def _number(v: Any) -> Optional[float]:
    """v as a finite non-zero float, else None (strings such as MPT's
    "inv_sqrt_d_model", booleans, None)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and f != 0 else None


def _transforms(model: Any) -> List[Tuple[_Factor, Optional[float]]]:
    """The (factor, soft cap) pairs the model's config allows (a factor: its
    value, and whether the logits are divided by it), the name's usual
    reading first (Granite divides by logits_scaling), no transform last."""
    factors: List[_Factor] = []
    for name in _FACTORS:
        v = _number(_config_value(model, name))
        if v is not None and v != 1.0:
            factors += [(v, True), (v, False)] if name == "logits_scaling" else [(v, False), (v, True)]
    caps: List[Optional[float]] = []
    for name in _SOFTCAPS:
        c = _number(_config_value(model, name))
        if c is not None and c > 0:
            caps.append(c)
    return [(f, c) for c in list(dict.fromkeys(caps)) + [None] for f in list(dict.fromkeys(factors)) + [_NO_FACTOR]]


class _HeadReached(BaseException):
    """Raised by the hook on the head: the model's forward stops there (its
    logits are never computed). BaseException: no model code catches it."""


def _run(model: Any, head: Any, ids: Any, mask: Any, stop: bool = False, replace: Any = None) -> Tuple[Any, Any, Any]:
    """The model's forward on ids: (the head's input, the head's output, the
    model's logits). stop: end the forward at the head (only its input is
    returned); replace(output): the tensor the head hands on instead."""
    import torch

    seen: List[Any] = []
    # (the hooks are on a module other threads may run: only this call's forward, on this thread, is seen;
    # another thread's may call them without kwargs while torch registers them in two steps)
    mine = threading.get_ident()

    def before(module: Any, args: Any, kwargs: Any = None) -> None:
        if threading.get_ident() != mine:
            return
        seen.append(args[0] if args else next(iter(kwargs.values()), None))
        if stop:
            raise _HeadReached

    def after(module: Any, args: Any, kwargs: Any, output: Any = None) -> Any:
        if threading.get_ident() != mine:
            return None
        # (a copy: the model may change its head's output in place, as
        # Chameleon masks its image tokens' columns; the check compares
        # the head's output as the head made it)
        seen.append(output.detach().clone() if isinstance(output, torch.Tensor) else output)
        return None if replace is None else replace(output)

    hooks = [head.register_forward_pre_hook(before, with_kwargs=True)]
    if not stop:
        hooks.append(head.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask)
    except _HeadReached:
        return seen[0], None, None
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        raise TypeError(f"model_logits: {type(model).__name__}'s forward never calls its output head "
                        f"({type(head).__name__}, get_output_embeddings()) as a module: build the logits with "
                        f"lmmetrics.projected(hidden, weight)")
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    return seen[0], seen[1], logits


def _autocast_state(device_type: str) -> Optional[Tuple[str, Any]]:
    """(device type, dtype) of the autocast active for that device, or None."""
    import torch

    try:
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        pass
    return None


def model_logits(model: Any, input_ids: Any, attention_mask: Any = None, *, check: bool = True,
                 check_positions: int = 8, chunk_bytes: Optional[int] = None) -> Projected:
    """Lazy logits of a Hugging Face causal LM on ``input_ids``: the model's
    forward runs once, up to its output head (which it never calls on the
    whole input); the head is applied a chunk of rows at a time by the
    metric that reads them.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM whose forward calls its output head
        (``get_output_embeddings()``) as a module.
    input_ids : torch.Tensor (B, T) or (T,)
        Token ids, on the model's device (one sequence gives logits of
        shape (T, V)).
    attention_mask : torch.Tensor (B, T), optional
        As the model takes it (a 4-D mask is passed on as it is).
    check : bool
        Before returning (default), run the model's own forward on the
        first ``check_positions`` attended positions of the first sequence
        twice: once as it is, and once with the head's output replaced by
        known values from 0.01 to 1000 in magnitude, which shows what the
        model does to its head's output (a factor, a soft cap, a change of
        dtype). The head's output must be its weight (and bias) applied as
        a linear layer, to the last bit of its dtype (a LoRA adapter or a
        forward hook on the head is refused); the transform is taken from
        the config's attributes that the probe confirms (``logit_scale``,
        ``logits_scaling``, ``final_logit_softcapping``, ...); a model none
        of them explains, or whose logits then still differ from these, is
        an error naming its class. The check sees those positions only: a
        model whose forward treats later positions or other sequences
        differently (none in transformers does) is not caught.
        ``check=False`` skips it, and is refused for a model whose config
        names an output transform (which way it applies is what the check
        finds out).
    check_positions : int
        How many positions the check compares (a model with rules on the
        length, such as a chunk size, needs a length it accepts).
    chunk_bytes : int, optional
        As `projected`'s.

    Returns
    -------
    Projected
        The model's logits, lazily: the head's input, weight and bias, and
        the factor, soft cap and logits dtype the check found (under
        ``torch.autocast``, the head is applied under the same autocast).
        The head's weight is held, not copied: it is read when a metric
        reads the logits, so change it in place (quantizing the model, say)
        only after that.

    Raises
    ------
    TypeError
        The model has no output head, its weight is not in memory (on the
        meta device: offloaded), its forward does not call the head, or it
        is an encoder-decoder model (T5, BART: its decoder reads the ids
        shifted right, so its logits are not a causal LM's).
    ValueError
        The lazy logits disagree with the model's own logits (an
        architecture with an output transform this function does not know),
        the model is in training mode with dropout (its logits are random:
        call ``model.eval()``), or ``check=False`` for a model whose config
        names an output transform.

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
    return _model_logits(model, input_ids, attention_mask, check, check_positions, chunk_bytes)


def _model_logits(model: Any, input_ids: Any, attention_mask: Any, check: bool, check_positions: int,
                  chunk_bytes: Optional[int], found: Optional[_Transform] = None) -> Projected:
    """model_logits; found: what the check of an earlier call on the same
    model found (`_findings` of its lazy logits: factor, soft cap,
    logits dtype), taken without a check (sliding windows check their
    first batch only)."""
    import torch

    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        # (BART's forward on input_ids alone runs, and its logits at t
        # predict input_ids[t]: scored with shift=True, as a causal LM's
        # lazy logits are, a plausible wrong number)
        raise TypeError(f"model_logits: {name} is an encoder-decoder model (config.is_encoder_decoder): its "
                        f"decoder reads the ids shifted right, so its logits at position t predict the token at "
                        f"t, not the next one; pass a causal LM (...ForCausalLM), or score model(input_ids, "
                        f"labels=labels).logits against the labels with shift=False")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(head, torch.nn.Module):
        raise TypeError(f"model_logits: {name} has no output head with a 2-D weight "
                        f"(get_output_embeddings() gave {type(head).__name__}): pass a causal LM "
                        f"(...ForCausalLM), or build the logits with lmmetrics.projected(hidden, weight)")
    if weight.device.type == "meta":
        raise TypeError(f"model_logits: {name}'s output head has its weight on the meta device (offloaded: "
                        f"accelerate's cpu_offload or a device_map with offloading): lazy logits read the weight "
                        f"itself; load the head's weight onto a device, or use model(input_ids).logits")
    bias = getattr(head, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    ids = torch.as_tensor(input_ids)
    one_sequence = ids.dim() == 1
    if one_sequence:
        ids = ids[None]
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=ids.device)
    if mask is not None and mask.dim() == 1:
        mask = mask[None]
    if mask is not None and mask.dim() not in (2, 4):
        raise ValueError(f"model_logits: attention_mask must be (B, T) (or the model's 4-D mask), got shape "
                         f"{tuple(mask.shape)}")
    autocast = _autocast_state(weight.device.type)
    # (factor, soft cap, logits dtype): an earlier call's findings, the
    # check's, or none at all (check=False, a config that names none)
    transform: _Transform = (_NO_FACTOR, None, None)
    if found is not None:
        transform = found
    else:
        dropout = _active_dropout(model)
        if dropout:
            raise ValueError(f"model_logits: {name} is in training mode with dropout ({dropout}): its logits "
                             f"differ at every forward; call model.eval() first")
        transforms = _transforms(model)
        if check:
            transform = _check_against_forward(model, name, head, weight, bias, ids, mask, transforms, autocast,
                                               check_positive_int("check_positions", check_positions))
        elif len(transforms) > 1:
            named = ", ".join(f"{n}={_config_value(model, n)!r}" for n in _FACTORS + _SOFTCAPS
                              if _number(_config_value(model, n)) is not None)
            raise ValueError(f"model_logits: {name}'s config names an output transform ({named}), and whether "
                             f"and which way the model applies it is what the check finds out: leave check=True, "
                             f"or build the logits with lmmetrics.projected(hidden, weight, bias, scale, softcap)")
    factor, cap, out_dtype = transform
    hidden = _run(model, head, ids, mask, stop=True)[0]
    if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:-1]) != tuple(ids.shape):
        raise TypeError(f"model_logits: {name}'s head receives "
                        f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}, "
                        f"not one hidden state a position of input_ids {tuple(ids.shape)}")
    if one_sequence:
        hidden = hidden[0]
    lazy = _projected_as(factor, hidden, weight, bias, cap, chunk_bytes, autocast, out_dtype)
    lazy.from_model = True
    return lazy


def _projected_as(factor: _Factor, hidden: Any, weight: Any, bias: Any, cap: Optional[float],
                  chunk_bytes: Optional[int], autocast: Optional[Tuple[str, Any]], out_dtype: Any) -> Projected:
    """The lazy logits of a model's head, transformed as the model does."""
    value, divide = factor
    return Projected(hidden, weight, bias, value, cap, chunk_bytes, _autocast=autocast, _out_dtype=out_dtype,
                     _divide=divide)


def _findings(lazy: Projected) -> _Transform:
    """What model_logits' check found, for a later call on the same model."""
    return lazy._factor(), lazy.softcap, lazy.out_dtype


def _active_dropout(model: Any) -> Optional[str]:
    """What drops out in the model's forward, if anything: a dropout module
    in training mode, or (the model in training mode) a dropout rate its
    config names, which attention code applies without a module."""
    import torch

    if not isinstance(model, torch.nn.Module) or not model.training:
        return None
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            return f"{type(m).__name__}(p={m.p:g})"
    config: Any = getattr(model, "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    for key, v in values.items():  # (not a classification or summary head's: a causal LM has none)
        if ("dropout" in key or "pdrop" in key) and not key.startswith(("classifier", "summary")) and \
                _number(v) is not None and 0 < float(v) < 1:
            return f"config.{key}={v:g}"
    return None


def _probe_values(out: torch.Tensor) -> torch.Tensor:
    """Values in out's shape and dtype (exact in it), every magnitude of
    _PROBE_AMPLITUDES in every row and, given rows enough, every column:
    +-(0.1 .. 1) times an amplitude."""
    import torch

    g = torch.Generator().manual_seed(0)
    u = torch.rand(out.shape, generator=g, dtype=torch.float64) * 0.9 + 0.1
    u = torch.where(torch.rand(out.shape, generator=g) < 0.5, -u, u)
    rows = torch.arange(out.shape[-2])[:, None]
    cols = torch.arange(out.shape[-1])[None, :]
    amp = torch.tensor(_PROBE_AMPLITUDES, dtype=torch.float64)[(rows + cols) % len(_PROBE_AMPLITUDES)]
    return (u * amp).to(out.dtype).to(out.device)


def _disagreement(want: torch.Tensor, got: torch.Tensor, eps: float, floor: float) -> Optional[str]:
    """None when got matches want (elementwise within 4 eps of their size
    plus floor, infinities equal, no NaN; and no common factor beyond
    rounding's: a least-squares relative factor within eps / 256), else what
    differs."""
    import torch

    w, g = want.double(), got.double()
    fin = torch.isfinite(w) & torch.isfinite(g)
    same = (w == g) & ~fin
    d = torch.where(fin, (w - g).abs(), 0.0)
    tol = 4 * eps * torch.maximum(w.abs(), g.abs()) + floor
    if not bool(((fin & (d <= tol)) | same).all()):
        worst = float(torch.where(fin, d, math.inf).max()) if not bool(fin.all()) else float(d.max())
        return f"by up to {worst:.3g}"
    gg = torch.where(fin, g, 0.0)
    denom = float((gg * gg).sum())
    factor = float((torch.where(fin, w - g, 0.0) * gg).sum()) / denom if denom > 0 else 0.0
    if abs(factor) > eps / 256 + 2.0**-23:
        return f"by a factor of 1 {'+' if factor > 0 else '-'} {abs(factor):.2e}"
    return None


def _check_against_forward(model: Any, name: str, head: Any, weight: Any, bias: Any, ids: torch.Tensor,
                           mask: Any, transforms: List[Tuple[_Factor, Optional[float]]],
                           autocast: Optional[Tuple[str, Any]], k: int) -> _Transform:
    """The transform (factor, soft cap, logits dtype) the model applies to
    its head's output, found by the model's forward on the first sequence's
    first k attended positions with the head's output replaced by probe
    values; then the lazy logits of those positions against the model's own
    logits there, from the same head input. Raises ValueError naming the
    model when either differs."""
    import torch

    m1: Any = None if mask is None else mask[:1]
    flat = m1 is not None and m1.dim() == 2  # (a 4-D mask: from the first position)
    first = 0 if not flat or not bool(m1.any()) else int(torch.nonzero(m1[0])[0, 0])
    end = min(ids.shape[1], first + k)
    pids = ids[:1, :end]
    pmask = None if m1 is None else m1[:, :end] if flat else m1[:, :, :end, :end]

    def forward(replace: Any = None) -> Tuple[Any, Any, Any]:
        try:
            return _run(model, head, pids, pmask, replace=replace)
        except Exception as e:  # the model's own error, as it is (an OOM stays one), with a note on where
            if hasattr(e, "add_note"):  # (Python 3.11+)
                e.add_note(f"(raised by {name}'s forward in model_logits' check, on the first {end} positions of "
                           f"the first sequence: a model with rules on the length, such as a chunk size, needs "
                           f"check_positions= a length it accepts)")
            raise

    h, raw, want = forward()
    if not isinstance(raw, torch.Tensor) or not isinstance(want, torch.Tensor) or want.shape != raw.shape:
        raise ValueError(f"model_logits: {name}'s logits are not its head's output, transformed element by "
                         f"element (head output {getattr(raw, 'shape', None)}, logits "
                         f"{getattr(want, 'shape', None)}): use model(input_ids).logits")
    if isinstance(h, torch.Tensor) and h.is_floating_point() and not bool(torch.isfinite(h).all()):
        raise ValueError(f"model_logits: {name}'s hidden states at its first positions hold NaN or inf (what its "
                         f"head receives): its logits would too; check the model (its weights, its dtype)")
    with torch.no_grad():
        lin = torch.nn.functional.linear(h, weight, bias)
    if lin.shape != raw.shape or lin.dtype != raw.dtype or \
            _disagreement(raw, lin, torch.finfo(raw.dtype).eps / 8, 1e-30) is not None:
        worst = float((lin.double() - raw.double()).abs().max()) if lin.shape == raw.shape else math.nan
        raise ValueError(f"model_logits: {name}'s output head is not its weight (and bias) applied as a linear "
                         f"layer: its output differs from that by up to {worst:.3g} on the first positions (a "
                         f"LoRA adapter, a forward hook or a quantized layer on the head, or a head module that "
                         f"does more, such as Dory's per-token logit scale?). Use "
                         f"model(input_ids).logits, or merge the adapter first")
    probe = _probe_values(raw)
    seen = forward(replace=lambda out: probe.clone())[2]
    out_dtype = want.dtype
    eps = max(torch.finfo(raw.dtype).eps, torch.finfo(out_dtype).eps)
    for factor, cap in transforms:
        if _disagreement(seen, _finish(probe.clone(), out_dtype, factor, [cap] if cap else []), eps, 1e-30) is None:
            break
    else:
        raise ValueError(
            f"model_logits: {name} transforms its head's output in a way lmmetrics does not know (none of a "
            f"factor or a soft cap from its config explains its logits). Use model(input_ids).logits, or "
            f"build the logits with lmmetrics.projected(hidden, weight, bias, scale, softcap)")
    rows = np.arange(first, end, dtype=np.int64)
    got = _projected_as(factor, h[0], weight, bias, cap, None, autocast, out_dtype).rows(rows)
    w = want[0, first:end]
    big = float(w.double().abs().max()) if w.numel() else 0.0
    floor = (1e-4 * (1.0 + big)) if eps < 1e-6 else 2 * eps * big
    why = _disagreement(w, got, eps, floor)
    if why is not None:
        raise ValueError(
            f"model_logits: the logits built from {name}'s head input and head differ from the model's own "
            f"{why} on its first positions: this architecture computes its logits in a way lmmetrics "
            f"does not know. Use model(input_ids).logits, or build them with "
            f"lmmetrics.projected(hidden, weight, bias, scale, softcap)")
    return factor, cap, (out_dtype if out_dtype != raw.dtype else None)
