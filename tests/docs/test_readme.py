"""Every ```python block of README.md runs as written, and prints what it
shows (the rules: tests/mdblocks.py)."""
from pathlib import Path

import pytest

from mdblocks import output_matches, run_section, sections

README = Path(__file__).resolve().parents[2] / "README.md"
SECTIONS = sections(README.read_text(encoding="utf-8"))


def test_readme_has_blocks():
    blocks = [b for _, bs in SECTIONS for b in bs]
    assert len(blocks) >= 1
    assert sum(b[2] is not None for b in blocks) >= 1


def test_output_matching():
    assert output_matches("a 1.000001\nb\nc 2\n", "a 1.000000\n...\nc 2")
    assert not output_matches("a 1.3\n", "a 1.0")
    assert output_matches("a 1.1\n", "a 1.0")
    assert not output_matches("x 1\n", "y 1")


def test_parsing():
    text = "\n".join([
        "## A", "```python", "x = 1", "```", "", "```", "out", "```",
        "<!-- readme-test: skip (needs a GPU) -->", "```python", "gpu()", "```",
        "## Speed", "```python", "slow()", "```", "### In speed", "```python", "slow()", "```",
        "## B", "```bash", "ls", "```", "```python", "y = 2", "```"])
    got = sections(text)
    assert [h for h, _ in got] == ["A", "B"]
    (_, a_blocks), (_, b_blocks) = got
    assert [(c, e, s is not None) for _, c, e, s in a_blocks] == [("x = 1", "out", False), ("gpu()", None, True)]
    assert [(c, e, s) for _, c, e, s in b_blocks] == [("y = 2", None, None)]
    # a docs page is one section
    whole = sections(text, by_heading=False)
    assert len(whole) == 1 and [c for _, c, _, _ in whole[0][1]] == ["x = 1", "gpu()", "y = 2"]


@pytest.mark.parametrize("heading,blocks", SECTIONS, ids=[h for h, _ in SECTIONS])
def test_readme_section(heading, blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_section("README.md", heading, blocks)
