"""What gets shipped: the sdist holds everything a build from it needs, and
(in CI) the tests run against the installed package, not the source tree."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import lmmetrics

ROOT = Path(__file__).resolve().parents[2]
IN_SOURCE_TREE = (ROOT / "setup.py").is_file() and (ROOT / "lmmetrics_c").is_dir()


@pytest.mark.skipif(os.environ.get("LMMETRICS_EXPECT_INSTALLED") != "1",
                    reason="tests the source tree, not an installed package (CI sets "
                           "LMMETRICS_EXPECT_INSTALLED=1 after installing the sdist)")
def test_the_installed_package_is_tested():
    path = Path(lmmetrics.__file__).resolve()
    assert "site-packages" in path.parts, path
    assert not str(path).startswith(str(ROOT / "src")), path


def _needed_files():
    """The files a build from the sdist (and its tests) needs, from the tree."""
    needed = {"README.md", "CONTRIBUTING.md", "LICENSE", "pyproject.toml", "setup.py", "MANIFEST.in", "mkdocs.yml"}
    for p in (ROOT / "docs").rglob("*.md"):
        needed.add(p.relative_to(ROOT).as_posix())  # tests/docs/test_docs.py runs their examples
    for p in (ROOT / "lmmetrics_c").iterdir():
        if p.is_file() and p.name != "_core.c" and p.suffix in (".c", ".h", ".pyx", ".pxd"):
            needed.add(p.relative_to(ROOT).as_posix())
    for p in (ROOT / "tests").rglob("*"):
        if p.is_file() and p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
            needed.add(p.relative_to(ROOT).as_posix())
    for p in (ROOT / "src" / "lmmetrics").rglob("*"):
        if p.is_file() and p.suffix in (".py", ".typed") and "__pycache__" not in p.parts:
            needed.add(p.relative_to(ROOT).as_posix())
    return needed


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """LMMETRICS_SDIST (CI passes the one it built), else one built here."""
    given = os.environ.get("LMMETRICS_SDIST")
    if given:
        return Path(given)
    # build.__main__, not build: after `pip install .` in an unpacked sdist,
    # setuptools' build/ folder in the current directory imports as a
    # namespace package named build, and `python -m build` then fails
    pytest.importorskip("build.__main__", reason="building an sdist needs the build package (pip install build)")
    out = tmp_path_factory.mktemp("sdist")
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(ROOT)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        last = [line for line in res.stderr.splitlines() if line.strip()][-1:] or ["no message"]
        pytest.skip(f"python -m build --sdist failed here: {last[0].strip()[:200]}")
    return next(out.glob("*.tar.gz"))


@pytest.mark.skipif(not IN_SOURCE_TREE, reason="checks the sdist against the source tree (setup.py, "
                                                 "lmmetrics_c/), which is not here")
def test_sdist_contents(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(_needed_files() - names)
    assert not missing, f"missing from {sdist.name}: {missing}"
    # the generated C is never shipped: a stale one would be built instead
    # of the .pyx, and a build from the sdist regenerates it anyway
    assert "lmmetrics_c/_core.c" not in names
    assert not [n for n in names if n.endswith((".so", ".pyd", ".o", ".pyc"))]
