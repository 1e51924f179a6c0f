"""Every ```python block of the pages in docs/ runs as written and prints
what it shows (one namespace a page; the rules: tests/mdblocks.py), and the
API pages name every public function and class."""
import re
from pathlib import Path

import pytest

import lmmetrics
from mdblocks import run_section, sections

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []
pytestmark = pytest.mark.skipif(not PAGES, reason="docs/ is not here (tests copied without the pages)")
RUNNABLE = [(p, s) for p in PAGES for s in sections(p.read_text(encoding="utf-8"), by_heading=False)]


def _name(p):
    return p.relative_to(ROOT).as_posix()


def test_pages_have_examples():
    assert len([b for _, (_, bs) in RUNNABLE for b in bs]) >= 12


@pytest.mark.parametrize("page,section", RUNNABLE, ids=[_name(p) for p, _ in RUNNABLE])
def test_docs_page(page, section, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_section(_name(page), *section)


def test_api_pages_cover_the_public_names():
    documented = set()
    for p in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: lmmetrics\.(\S+)", p.read_text(encoding="utf-8"), re.M))
    public = {n for n in lmmetrics.__all__ if n != "__version__"}
    public |= {"torchmetrics." + n for n in ("Perplexity", "BitsPerByte", "LanguageModelMetrics")}
    assert not sorted(public - documented)


def test_links_between_pages_resolve():
    for p in PAGES + [ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", p.read_text(encoding="utf-8")):
            assert (p.parent / target).resolve().is_file(), f"{_name(p)}: broken link {target}"
