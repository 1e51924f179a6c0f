"""Run the ```python blocks of a Markdown file (README.md, docs/*.md) as written.

The blocks of one section run in order in one namespace: a section is a
``##`` or ``###`` heading of README.md, a whole page of docs/. A block right
after ``<!-- readme-test: skip (reason) -->`` (or ``docs-test: skip``) is
skipped; blocks under ``## Speed`` are not run. Where a bare ``` block follows
a python block, it is the block's printed output: the text must match and
each number must match to the precision it is shown with (within 2 units of
its last digit, or 1e-5 relative); a line ``...`` stands for any number of
lines. A section whose block imports an optional package that is absent
(torch, transformers, ...) is skipped, naming it."""
import contextlib
import io
import math
import re

import pytest

SKIP = re.compile(r"<!--\s*(?:readme|docs)-test:\s*skip\b")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan")
# the packages the [test-all] extra brings; without them their blocks are skipped
OPTIONAL = {"torch", "transformers", "tokenizers", "sentencepiece", "torchmetrics", "safetensors",
            "lm_eval", "triton", "tqdm", "ml_dtypes", "scipy", "lightning", "pytorch_lightning"}


def sections(text, by_heading=True):
    """[(heading, [(first line number, code, expected output or None, skip reason or None)])]"""
    lines = text.splitlines()
    out, heading, blocks, i, speed = [], None, [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("## ") or line.startswith("### "):
            if line.startswith("## "):
                speed = line.strip() == "## Speed"
            if by_heading:
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


def run_section(name, heading, blocks):
    """Run one section's blocks in one namespace (in the current directory)."""
    ns = {"__name__": "__mdblocks__"}
    ran = 0
    for line, code, expected, skip in blocks:
        if skip:
            continue
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, f"{name}:{line}", "exec"), ns)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OPTIONAL:
                pytest.skip(f"{name}:{line} needs {e.name}, which is not installed")
            raise
        ran += 1
        if expected is not None:
            assert output_matches(buf.getvalue(), expected), (
                f"{name}:{line}: the printed output differs from the one shown\n"
                f"--- printed ---\n{buf.getvalue()}--- shown ---\n{expected}")
    if not ran:
        pytest.skip(f"every block of {heading!r} in {name} is marked to skip")
