"""The examples in the public modules' docstrings run and print what they
show (doctest). Those that use torch, tokenizers or torchmetrics are skipped
when it is absent; help() on the torchmetrics classes shows their own
docs."""
import doctest
import importlib
import re

import pytest

MODULES = ["metrics", "evaluation", "comparison", "windows", "text", "tokens", "convert", "probs", "ranking",
           "torchmetrics", "transformers", "lm_eval"]
OPTIONAL = ("torch", "tokenizers", "transformers", "torchmetrics")
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _tests():
    out = []
    finder = doctest.DocTestFinder()
    for name in MODULES:
        try:
            module = importlib.import_module("lmmetrics." + name)
        except ModuleNotFoundError as e:  # lmmetrics.torchmetrics without torchmetrics
            out.append(pytest.param(None, marks=pytest.mark.skip(reason=f"lmmetrics.{name} needs {e.name}"),
                                    id=f"lmmetrics.{name}"))
            continue
        for test in finder.find(module):
            if test.examples:
                out.append(pytest.param(test, id=test.name))
    return out


TESTS = _tests()


def test_every_public_function_has_an_example():
    names = {p.id.rsplit(".", 1)[-1] for p in TESTS}
    for want in ["token_nll", "cross_entropy", "perplexity", "bits_per_token", "bits_per_byte",
                 "bits_per_character", "token_entropy", "token_kl", "kl_divergence", "loglikelihood",
                 "evaluate", "Evaluator", "evaluate_bpb", "compare", "sliding_window_nll", "text_metrics",
                 "token_bytes"]:
        assert want in names, want


@pytest.mark.parametrize("test", TESTS)
def test_docstring_examples(test):
    source = "\n".join(e.source for e in test.examples)
    for mod in OPTIONAL:
        if re.search(rf"\b(import|from) {mod}\b", source):
            pytest.importorskip(mod)
    # (verbose=False: doctest reads -v from sys.argv, and a verbose runner
    # writes "Trying:" into the output the example is checked against)
    runner = doctest.DocTestRunner(verbose=False, optionflags=FLAGS)
    test.globs = dict(test.globs)
    runner.run(test, out=lambda s: print(s, end=""))
    assert runner.failures == 0, f"{test.name}: {runner.failures} example(s) failed (output above)"


def test_help_of_torchmetrics_classes_shows_their_docs():
    pytest.importorskip("torchmetrics")
    import pydoc

    from lmmetrics.torchmetrics import BitsPerByte, LanguageModelMetrics, Perplexity

    for cls in (Perplexity, BitsPerByte, LanguageModelMetrics):
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        assert "Initialize internal Module state" not in text
        assert "Parameters" in text and "Examples" in text


_SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|ref|const|term):`")


def test_docstrings_use_no_sphinx_roles():
    """The API pages render the docstrings with mkdocstrings, which shows a
    Sphinx role (:func:`x`) as raw text: names are written in backticks."""
    import pathlib

    import lmmetrics

    found = []
    for path in sorted(pathlib.Path(lmmetrics.__file__).parent.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _SPHINX_ROLE.search(line):
                found.append(f"{path.name}:{n}: {line.strip()}")
    assert not found, "Sphinx roles in docstrings:\n" + "\n".join(found)


def test_api_signatures_name_every_option():
    """The API pages show the implementation's signature (mkdocs.yml:
    show_overloads false), and it names every option: no **options."""
    import inspect
    import pathlib

    import lmmetrics

    mkdocs = pathlib.Path(__file__).resolve().parents[2] / "mkdocs.yml"
    if mkdocs.exists():
        assert re.search(r"^\s*show_overloads: false\s*$", mkdocs.read_text(encoding="utf-8"), re.M)
    for name in lmmetrics.__all__:
        obj = getattr(lmmetrics, name)
        if inspect.isfunction(obj):
            kinds = [p.kind for p in inspect.signature(obj).parameters.values()]
            assert inspect.Parameter.VAR_KEYWORD not in kinds, name
