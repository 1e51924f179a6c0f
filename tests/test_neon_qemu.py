"""The NEON kernels on an x86 host: tests/c/segment_harness.c cross-compiled
for aarch64 and run under qemu (NEON and portable segment kernels against a
float64 reference, on random rows). Skipped without the cross compiler and
qemu (apt: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static), or
outside the source tree. On an aarch64 host the whole suite runs the NEON
path natively instead."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_DIR = ROOT / "lmmetrics_c"
HARNESS = ROOT / "tests" / "c" / "segment_harness.c"
CC = os.environ.get("LMMETRICS_AARCH64_CC", "aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


@pytest.mark.skipif(shutil.which(CC) is None or QEMU is None, reason="no aarch64 cross compiler or qemu-aarch64")
@pytest.mark.skipif(not (C_DIR / "lm_isa_neon.c").is_file() or not HARNESS.is_file(), reason="needs the source tree")
def test_neon_segment_kernels_under_qemu(tmp_path):
    exe = tmp_path / "segment_harness"
    # the flags the build gives every unit (no ISA flag: NEON is baseline)
    build = [CC, "-O3", "-std=c99", "-fno-math-errno", "-fno-trapping-math", "-fno-wrapv", "-Wall",
             "-static", "-I", str(C_DIR), str(HARNESS), str(C_DIR / "lm_isa_neon.c"),
             str(C_DIR / "lm_isa_scalar.c"), "-lm", "-o", str(exe)]
    res = subprocess.run(build, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr, res.stderr
    res = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
