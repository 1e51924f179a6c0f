"""show_config, the ISA override, and agreement between SIMD paths."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import lmmetrics
from lmmetrics import _core
from helpers import DTYPES, ISAS, random_logits


def test_show_config(capsys):
    cfg = lmmetrics.show_config()
    out = capsys.readouterr().out
    assert cfg["version"] == lmmetrics.__version__ and lmmetrics.__version__ in out
    assert cfg["isa"] in cfg["isas_supported"] and "scalar" in cfg["isas_built"]
    assert isinstance(cfg["openmp"], bool) and cfg["threads"] >= 1
    assert "-O3" in cfg["cflags"] or "/O2" in cfg["cflags"]
    # which OpenMP the build used: its flags, or none for a serial core
    assert (cfg["openmp_build"] == "none") == (not cfg["openmp"]) and cfg["openmp_build"] in out
    for bad in ("-ffast-math", "-march=native", "-Ofast"):
        assert bad not in cfg["cflags"]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"),
                    reason="x86-64 Linux builds every SIMD path")
def test_every_x86_path_is_built():
    # a path whose translation unit fails to compile is left out silently
    # by the build (for compilers without the flags): here it must not be
    assert {"scalar", "avx2", "avx512"} <= set(lmmetrics.show_config(False)["isas_built"])


@pytest.mark.parametrize("name", ISAS)
def test_env_var_forces_the_path(name):
    env = dict(os.environ, LMMETRICS_ISA=name)
    out = subprocess.run([sys.executable, "-c", "import lmmetrics; print(lmmetrics.show_config(False)['isa'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == name


def test_env_var_unknown_path_fails_loudly():
    env = dict(os.environ, LMMETRICS_ISA="sse9")
    res = subprocess.run([sys.executable, "-c", "import lmmetrics"], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "LMMETRICS_ISA=sse9" in res.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_path_agrees(dtype):
    rng = np.random.default_rng(20)
    z = random_logits(rng, (12, 3001), dtype)
    t = rng.integers(0, 3001, 12)
    results = {}
    before = _core.active_isa()
    try:
        for name in ISAS:
            _core.set_isa(name)
            results[name] = lmmetrics.token_nll(z, t).astype(np.float64)
    finally:
        _core.set_isa(before)
    base = results["scalar"]
    for name, got in results.items():
        np.testing.assert_allclose(got, base, atol=2e-6 if dtype != np.float64 else 1e-12, err_msg=name)


@pytest.mark.skipif(platform.machine().lower() not in ("aarch64", "arm64"), reason="aarch64 builds the NEON path")
def test_neon_path_is_built_on_aarch64():
    cfg = lmmetrics.show_config(False)
    assert "neon" in cfg["isas_built"] and cfg["isa_best"] == "neon"
