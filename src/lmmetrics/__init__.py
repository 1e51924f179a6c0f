"""lmmetrics: language-model evaluation metrics from logits, in one read.

Per-token NLL, cross-entropy, perplexity, bits per token / byte / character,
predictive entropy, top-1 accuracy, KL divergence and per-sequence
log-likelihoods (lm-eval's multiple-choice ``loglikelihood``) from logits
shaped (..., V) and integer targets, computed by a fused log-softmax + gather kernel
(C, SIMD, OpenMP, GIL released) that agrees with a float64 reference; CUDA
tensors are computed by torch on their device. `evaluate` and
`Evaluator` give every metric from one read, `compare` a model
against a reference model. See `lmmetrics.convert` for unit conversions
and `lmmetrics.probs` for measures over explicit probability vectors;
`lmmetrics.torchmetrics` (imported on demand) holds torchmetrics
``Metric`` classes. These are metrics, not training losses: no gradient
flows through them.
"""
from . import convert, probs
from ._engine.config import apply_env_isa as _apply_env_isa
from ._engine.config import show_config
from ._engine.lazy import Projected, model_logits, projected
from ._engine.cuda.layout import set_cuda_chunk_bytes
from ._version import __version__
from .comparison import Comparison, Distribution, Estimate, compare
from .documents import Documents
from .evaluation import Evaluator, Metrics, evaluate, evaluate_bpb
from .tokens import token_bytes
from .windows import sliding_window_nll
from .text import text_metrics
from .metrics import (Deferred, bits_per_byte, bits_per_character, bits_per_token, cross_entropy, kl_divergence,
                      loglikelihood, perplexity, token_entropy, token_kl, token_nll)
from .ranking import (Calibration, calibration, expected_calibration_error, mean_reciprocal_rank, token_confidence,
                      token_rank, top_k_accuracy)

_apply_env_isa()

__all__ = [
    "__version__", "show_config", "token_nll", "cross_entropy", "perplexity", "bits_per_token", "Deferred",
    "bits_per_byte", "bits_per_character", "token_entropy", "token_kl", "kl_divergence",
    "loglikelihood",
    "evaluate", "Evaluator", "Metrics", "Documents", "evaluate_bpb", "compare", "Comparison", "Estimate",
    "Distribution", "set_cuda_chunk_bytes", "projected", "model_logits", "Projected", "sliding_window_nll", "text_metrics", "token_bytes", "convert", "probs",
    "token_rank", "top_k_accuracy", "mean_reciprocal_rank", "token_confidence", "expected_calibration_error",
    "calibration", "Calibration",
]
