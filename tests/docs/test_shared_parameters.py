"""The numpydoc parameter texts the public functions share stay identical.

The texts are written out in each docstring (the docs are rendered from the
source statically, so no templating), and a parameter's meaning differs in
places (the rank functions' ``shift``, ``token_confidence``'s): each
parameter below declares its variants, the callables that share one text.
Every public callable documenting the parameter is in one variant; the
copies within a variant are identical. Editing one copy means editing its
variant's others, or declaring a new variant here."""
import inspect
import re

import pytest

import lmmetrics

# the callables that most variants group
_NLL = ["bits_per_byte", "bits_per_character", "bits_per_token", "compare", "cross_entropy", "evaluate",
        "perplexity", "token_nll"]
_RANKS = ["calibration", "mean_reciprocal_rank", "top_k_accuracy"]
_TORCHMETRICS = ["torchmetrics.BitsPerByte", "torchmetrics.LanguageModelMetrics", "torchmetrics.Perplexity"]
VARIANTS = {
    "logits": [["Evaluator.update", "kl_divergence", "token_entropy", "token_kl"] + _NLL,
               _RANKS + ["token_confidence", "token_rank"], ["expected_calibration_error"], ["loglikelihood"]],
    "targets": [["Evaluator.update"] + _NLL, _RANKS + ["token_rank"], ["expected_calibration_error"],
                ["loglikelihood"]],
    "reference_logits": [["compare", "kl_divergence", "token_kl"], ["Evaluator.update", "evaluate"]],
    "shift": [["Evaluator", "loglikelihood"] + _NLL, _RANKS, _TORCHMETRICS, ["expected_calibration_error"],
              ["token_confidence"], ["token_rank"]],
    "softcap": [["Evaluator", "kl_divergence", "loglikelihood", "token_entropy", "token_kl"] + _NLL + _TORCHMETRICS,
                _RANKS, ["evaluate_bpb"], ["expected_calibration_error"], ["projected"], ["token_confidence"],
                ["token_rank"]],
    "num_threads": [["Evaluator", "kl_divergence", "loglikelihood", "token_entropy", "token_kl"] + _NLL
                    + _TORCHMETRICS, _RANKS, ["expected_calibration_error"], ["sliding_window_nll"],
                    ["text_metrics"], ["token_confidence"], ["token_rank"]],
    "ignore_index": [["Evaluator", "loglikelihood"] + _NLL, _RANKS, _TORCHMETRICS, ["expected_calibration_error"],
                     ["token_rank"]],
    "sync": [["cross_entropy"], ["bits_per_token", "perplexity"]],
}
_RULE = re.compile(r"-{3,}")


def _parameters(doc):
    """{name: its whole entry (the heading line and the indented text)} of
    a numpydoc Parameters section (one entry may name several)."""
    lines = inspect.cleandoc(doc or "").split("\n")
    out, names, inside = {}, [], False
    for i, line in enumerate(lines):
        heading = i + 1 < len(lines) and line.strip() and not line.startswith(" ") and _RULE.fullmatch(
            lines[i + 1].strip())
        if heading:
            inside, names = line.strip() == "Parameters", []
            continue
        if not inside or _RULE.fullmatch(line.strip()):
            continue
        if line and not line.startswith(" "):
            names = [n.strip() for n in line.split(":")[0].split(",")]
            for n in names:
                out[n] = [line]
        elif names:
            for n in names:
                out[n].append(line)
    return {n: "\n".join(text).rstrip() for n, text in out.items()}


def _public():
    """{name: callable} of the documented public functions, classes and
    the classes' public methods."""
    found = {}
    for name in lmmetrics.__all__:
        obj = getattr(lmmetrics, name)
        if callable(obj):
            found[name] = obj
        if inspect.isclass(obj):
            found.update({f"{name}.{m}": f for m, f in vars(obj).items()
                          if callable(f) and not m.startswith("_") and f.__doc__})
    try:
        import lmmetrics.torchmetrics as tm
    except ImportError:  # (torchmetrics absent: its classes are not checked)
        return found, False
    found.update({f"torchmetrics.{n}": getattr(tm, n) for n in tm.__all__})
    return found, True


@pytest.mark.parametrize("param", sorted(VARIANTS))
def test_shared_parameter_texts_stay_identical(param):
    public, with_tm = _public()
    copies = {name: _parameters(obj.__doc__).get(param) for name, obj in public.items()}
    copies = {name: text for name, text in copies.items() if text is not None}
    declared = [n for group in VARIANTS[param] for n in group if with_tm or not n.startswith("torchmetrics.")]
    assert sorted(copies) == sorted(declared), (
        f"{param}: documented by {sorted(set(copies) - set(declared))} (declare them in a variant here), "
        f"declared but not documented by {sorted(set(declared) - set(copies))}")
    for group in VARIANTS[param]:
        texts = {copies[n] for n in group if n in copies}
        assert len(texts) <= 1, f"{param}: the copies in {group} differ:\n\n" + "\n\n".join(sorted(texts))
