"""Every ```python block of README.md (outside "## Speed") runs as written.

The blocks of one section (a ``##`` or ``###`` heading) run in order in one
namespace. A block right after ``<!-- readme-test: skip (reason) -->`` is
skipped. Where a bare ``` block follows a python block, it is the block's
printed output: the text must match and each number must match to the
precision it is shown with (within 2 units of its last digit, or 1e-5
relative); a line ``...`` stands for any number of lines."""
import contextlib
import io
import math
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan")


def sections(text=None):
    """[(heading, [(first line number, code, expected output or None, skip reason or None)])]"""
    lines = (README.read_text(encoding="utf-8") if text is None else text).splitlines()
    out, heading, blocks, i, speed = [], None, [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("## ") or line.startswith("### "):
            if line.startswith("## "):
                speed = line.strip() == "## Speed"
            if blocks:
                out.append((heading, blocks))
            heading, blocks = line.lstrip("# ").strip(), []
            i += 1
            continue
        if line.startswith("```"):
            lang = line[3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 1:end])
            if lang == "python" and not speed:
                prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                skip = prev.strip() if SKIP.search(prev) else None
                expected = None
                k = end + 1
                while k < len(lines) and not lines[k].strip():
                    k += 1
                if k < len(lines) and lines[k].strip() == "```":
                    stop = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
                    expected = "\n".join(lines[k + 1:stop])
                    end = stop
                blocks.append((i + 1, body, expected, skip))
            i = end + 1
            continue
        i += 1
    if blocks:
        out.append((heading, blocks))
    return out


SECTIONS = sections()


def _close(got, want):
    if want in ("inf", "nan", "-inf", "+inf"):
        return got == want
    g, w = float(got), float(want)
    digits = len(want.split(".")[1].split("e")[0].split("E")[0]) if "." in want else 0
    return math.isclose(g, w, rel_tol=1e-5, abs_tol=2 * 10.0 ** -digits)


def _line_matches(got, want):
    g_nums, w_nums = NUMBER.findall(got), NUMBER.findall(want)
    if NUMBER.sub("#", got).rstrip() != NUMBER.sub("#", want).rstrip() or len(g_nums) != len(w_nums):
        return False
    return all(_close(a, b) for a, b in zip(g_nums, w_nums))


def output_matches(got, want):
    """Whether the printed lines match the shown ones, ``...`` matching any run of lines."""
    g, w = got.rstrip("\n").splitlines(), want.rstrip("\n").splitlines()

    def match(i, j):
        if j == len(w):
            return i == len(g)
        if w[j].strip() == "...":
            return any(match(k, j + 1) for k in range(i, len(g) + 1))
        return i < len(g) and _line_matches(g[i], w[j]) and match(i + 1, j + 1)

    return match(0, 0)


def test_readme_has_blocks():
    blocks = [b for _, bs in SECTIONS for b in bs]
    assert len(blocks) >= 10
    assert sum(b[2] is not None for b in blocks) >= 2


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


@pytest.mark.parametrize("heading,blocks", SECTIONS, ids=[h for h, _ in SECTIONS])
def test_readme_section(heading, blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__readme__"}
    ran = 0
    for line, code, expected, skip in blocks:
        if skip:
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"README.md:{line}", "exec"), ns)
        ran += 1
        if expected is not None:
            assert output_matches(buf.getvalue(), expected), (
                f"README.md:{line}: the printed output differs from the one shown\n"
                f"--- printed ---\n{buf.getvalue()}--- shown ---\n{expected}")
    if not ran:
        pytest.skip(f"every block of {heading!r} is marked to skip")
