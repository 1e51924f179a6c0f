"""lmmetrics: language-model evaluation metrics from logits, in one read.

Per-token NLL, cross-entropy, perplexity, bits per token / byte / character
from logits shaped (..., V) and integer targets, computed by a fused
log-softmax + gather kernel (C, SIMD, OpenMP, GIL released) that agrees with
a float64 reference. See :mod:`lmmetrics.convert` for unit conversions and
:mod:`lmmetrics.probs` for measures over explicit probability vectors.
"""
from . import convert, probs
from ._config import apply_env_isa as _apply_env_isa
from ._config import show_config
from ._version import __version__
from .metrics import (bits_per_byte, bits_per_character, bits_per_token, cross_entropy, perplexity,
                      token_nll)

_apply_env_isa()

__all__ = [
    "__version__", "show_config", "token_nll", "cross_entropy", "perplexity", "bits_per_token",
    "bits_per_byte", "bits_per_character", "convert", "probs",
]
