"""The NEON kernels on an x86 host: tests/c/segment_harness.c cross-compiled
for aarch64 and run under qemu (NEON and portable segment kernels against a
float64 reference, on random rows, in every dtype; float64 in double lanes,
with its edge rows, held to float64's 1e-13 contract). Skipped without the
cross compiler and qemu (apt: gcc-aarch64-linux-gnu libc6-dev-arm64-cross
qemu-user-static), or outside the source tree. On an aarch64 host the whole
suite runs the NEON path natively instead. The same segment harness also
runs natively on the x86 units the host has (AVX2, AVX-512), built with
setup.py's flags for them (about 30 s each, mostly the build)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import Jobs

ROOT = Path(__file__).resolve().parents[2]
C_DIR = ROOT / "lmmetrics_c"
HARNESS = ROOT / "tests" / "c" / "segment_harness.c"
DRIVER_HARNESS = ROOT / "tests" / "c" / "driver_harness.c"
CC = os.environ.get("LMMETRICS_AARCH64_CC", "aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


def _why_not(*needs):
    """Why a test skips (the first of its needs, (missing, reason) pairs,
    missing), or None."""
    return next((why for missing, why in needs if missing), None)


_QEMU = (shutil.which(CC) is None or QEMU is None, "no aarch64 cross compiler or qemu-aarch64")
_TREE = "needs the source tree"
NEON_SKIP = _why_not(_QEMU, (not (C_DIR / "lm_isa_neon.c").is_file() or not HARNESS.is_file(), _TREE))
DRIVER_SKIP = _why_not(_QEMU, (not DRIVER_HARNESS.is_file() or not (C_DIR / "lm_driver.c").is_file(), _TREE))
X86_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"],
             "avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c", "-mpopcnt"]}
HOST_CC = os.environ.get("CC", "gcc")


def x86_skip(unit):
    from lmmetrics import _core

    return _why_not((shutil.which(HOST_CC) is None, "no C compiler"),
                    (not HARNESS.is_file() or not (C_DIR / "lm_isa_avx2.c").is_file(), _TREE),
                    (not _core.isa_supported(unit), f"this CPU lacks {unit}"))


def _run(cmd, timeout=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _run_under_qemu(tmp_path, sources, defines=()):
    """Builds the C sources with the NEON and portable units for aarch64,
    with the flags the build gives every unit (no ISA flag: NEON is
    baseline), runs them under qemu and returns their output."""
    exe = tmp_path / "harness"
    build = [CC, "-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-wrapv",
             "-Wall", "-static", *defines, "-I", str(C_DIR), *map(str, sources), str(C_DIR / "lm_isa_neon.c"),
             str(C_DIR / "lm_isa_scalar.c"), "-lm", "-o", str(exe)]
    res = _run(build)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr, res.stderr
    res = _run([QEMU, str(exe)], timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
    return res.stdout


def _run_x86(tmp_path, unit):
    """The segment harness built with setup.py's flags for the x86 unit and
    run natively; its output."""
    exe = tmp_path / "harness"
    base = [HOST_CC, "-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-wrapv",
            "-Wall", "-I", str(C_DIR)]
    objs = []
    for src, flags in ((C_DIR / f"lm_isa_{unit}.c", X86_FLAGS[unit]), (C_DIR / "lm_isa_scalar.c", [])):
        objs.append(tmp_path / (src.stem + ".o"))
        res = _run(base + flags + ["-c", str(src), "-o", str(objs[-1])])
        assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    res = _run(base + [f"-DLM_TEST_UNIT=lm_unit_{unit}", f"-DLM_HAVE_{unit.upper()}", str(HARNESS),
                       *map(str, objs), "-lm", "-o", str(exe)])
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    res = _run([str(exe)], timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def harnesses(request, tmp_path_factory):
    """Each test's build and run, two at a time in the background (`Jobs`);
    a test that skips never asks for its own."""
    jobs = {}
    if not NEON_SKIP:
        jobs["test_neon_segment_kernels_under_qemu"] = lambda d=tmp_path_factory.mktemp("neon"): _run_under_qemu(
            d, [HARNESS])
    if not DRIVER_SKIP:
        jobs["test_neon_driver_float64_under_qemu"] = lambda d=tmp_path_factory.mktemp("driver"): _run_under_qemu(
            d, [DRIVER_HARNESS, C_DIR / "lm_driver.c"], ["-DLM_HAVE_NEON"])
    jobs.update({f"test_x86_segment_kernels_natively[{unit}]":
                 (lambda unit=unit, d=tmp_path_factory.mktemp(unit): _run_x86(d, unit))
                 for unit in X86_FLAGS if not x86_skip(unit)})
    pool = Jobs(request, jobs)
    yield pool
    pool.close()


@pytest.mark.skipif(NEON_SKIP is not None, reason=str(NEON_SKIP))
def test_neon_segment_kernels_under_qemu(harnesses, request):
    out = harnesses.result(request)
    # every dtype ran on the NEON unit: float64 in its double lanes, not
    # left to the portable unit (the harness skips a dtype a unit lacks)
    assert "dtypes f32 f16 bf16 f64" in out, out


@pytest.mark.skipif(DRIVER_SKIP is not None, reason=str(DRIVER_SKIP))
def test_neon_driver_float64_under_qemu(harnesses, request):
    """lm_run on aarch64 picks the NEON path and its float64 kernels: every
    output of float64 jobs (NLL, entropy, argmax, rank, top_logprob, KL,
    the totals; softcap or not) matches the portable path's within 1e-13."""
    harnesses.result(request)


@pytest.mark.parametrize("unit", sorted(X86_FLAGS))
def test_x86_segment_kernels_natively(harnesses, request, unit):
    """The same harness on this host's x86 units (built with setup.py's
    flags for them, run where the CPU has them): every segment kernel
    against the float64 reference and the portable unit, the rank's tie
    rule on rows full of ties, targets in and out of the segment."""
    if x86_skip(unit):
        pytest.skip(x86_skip(unit))
    out = harnesses.result(request)
    assert "dtypes f32 f16 bf16 f64" in out, out
