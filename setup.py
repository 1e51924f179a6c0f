"""Build of the native core lmmetrics._core.

The Cython binding and the driver are compiled with the portable flags
below (plus OpenMP when the compiler has it). Each SIMD path is its own
translation unit, compiled with its own -m flags only, and linked in when
the compiler accepts those flags; the driver picks one at run time by cpuid.
Never -ffast-math (it deletes the NaN checks) and never -march=native (the
wheel must run on any x86-64).
"""
import os
import platform
import shlex
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

C_DIR = "lmmetrics_c"
# -fno-wrapv undoes the -fwrapv in Python's own CFLAGS, which slows the
# streaming kernel loops by a quarter (the core relies on no signed wrap).
BASE_FLAGS = ["-O3", "-std=c99", "-fno-math-errno", "-fno-trapping-math", "-fno-wrapv", "-fvisibility=hidden"]
OPENMP_FLAGS = ["-fopenmp"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
}
# Release builds carry no debug info (the core: 6.3 MB with -g, 0.74 MB);
# LMMETRICS_DEBUG=1 keeps Python's -g. Compile flags, then link flags.
RELEASE_FLAGS = ([], []) if os.environ.get("LMMETRICS_DEBUG") == "1" else (
    ["-g0"], [] if sys.platform == "darwin" else ["-s"])
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")


def _try_compile(compiler, code, flags, link=False):
    """True when `compiler` builds `code` with `flags` (and links it if asked)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(code)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            if link:
                compiler.link_executable(objs, os.path.join(tmp, "probe"), extra_postargs=flags)
        except Exception:
            return False
    return True


PROBE_OPENMP = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0?0:1;}\n"
PROBE_ISA = {
    "avx2": "#include <immintrin.h>\nint main(void){__m256 x=_mm256_fmadd_ps(_mm256_set1_ps(1),"
            "_mm256_set1_ps(2),_mm256_cvtph_ps(_mm_setzero_si128()));return (int)_mm256_cvtss_f32(x);}\n",
    "avx512": "#include <immintrin.h>\nint main(void){__m512 x=_mm512_scalef_ps(_mm512_set1_ps(1),"
              "_mm512_set1_ps(2));__m512i m=_mm512_max_epi16(_mm512_set1_epi16(1),_mm512_set1_epi16(2));"
              "return (int)_mm512_reduce_add_ps(x)+_mm512_reduce_max_epi32(m);}\n",
}


class BuildExt(build_ext):
    def build_extensions(self):
        cc = self.compiler
        cc_flags = list(BASE_FLAGS)
        link_flags = list(RELEASE_FLAGS[1])
        if os.environ.get("LMMETRICS_NO_OPENMP") != "1" and _try_compile(cc, PROBE_OPENMP, OPENMP_FLAGS, link=True):
            cc_flags += OPENMP_FLAGS
            link_flags += OPENMP_FLAGS
        else:
            self.warn("lmmetrics: the compiler has no OpenMP; building a serial core")
        isas = ["scalar"]
        objects = self.compiler.compile([os.path.join(C_DIR, "lm_isa_scalar.c")], output_dir=self.build_temp,
                                        include_dirs=[C_DIR], extra_postargs=BASE_FLAGS + RELEASE_FLAGS[0])
        for isa, flags in ISA_FLAGS.items():
            if IS_X86 and _try_compile(cc, PROBE_ISA[isa], BASE_FLAGS + flags):
                objects += cc.compile([os.path.join(C_DIR, f"lm_isa_{isa}.c")], output_dir=self.build_temp,
                                      include_dirs=[C_DIR], extra_postargs=BASE_FLAGS + flags + RELEASE_FLAGS[0])
                isas.append(isa)
            else:
                self.warn(f"lmmetrics: the compiler does not build the {isa} path; leaving it out")
        for ext in self.extensions:
            ext.extra_objects = objects + list(ext.extra_objects or [])
            ext.extra_compile_args = cc_flags + RELEASE_FLAGS[0] + list(ext.extra_compile_args or [])
            ext.extra_link_args = link_flags + list(ext.extra_link_args or [])
            ext.define_macros = list(ext.define_macros or []) + [
                (f"LM_HAVE_{isa.upper()}", "1") for isa in isas if isa != "scalar"] + [
                ("LM_CFLAGS", '"%s"' % " ".join(cc_flags)),
                ("LM_ISAS_BUILT", '"%s"' % " ".join(isas)),
            ]
        super().build_extensions()


def extensions():
    from Cython.Build import cythonize

    ext = Extension(
        "lmmetrics._core",
        sources=[os.path.join(C_DIR, "_core.pyx"), os.path.join(C_DIR, "lm_driver.c")],
        include_dirs=[C_DIR],
        # the hand-written units only: never the generated _core.c
        depends=sorted(os.path.join(C_DIR, f) for f in os.listdir(C_DIR)
                       if f.startswith("lm_") and f.endswith((".h", ".c"))),
    )
    return cythonize([ext], compiler_directives={"language_level": 3})


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
