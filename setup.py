"""Build of the native core lmmetrics._core.

The Cython binding and the driver are compiled with the portable flags
below (plus OpenMP when the compiler has it). Each SIMD path is its own
translation unit, compiled with its own ISA flags only, and linked in when
the compiler applies those flags; the driver picks one at run time (cpuid on
x86; NEON is baseline on aarch64). Never -ffast-math (it deletes the NaN
checks) and never -march=native (the wheel must run on any CPU of its
architecture).

Compilers: GCC, Clang (Apple's too) and MSVC; every per-compiler choice
(base flags, ISA flags, OpenMP, release flags) is made in this file, in
`_flags_for`. The target architecture is the compiler's, found by compiling
probes (so cross builds, ARCHFLAGS and _PYTHON_HOST_PLATFORM are honoured),
never the build host's platform.machine(). A macOS universal2 build (two
-arch flags) matches neither target and gets the portable path only: build
one wheel per architecture (as the cibuildwheel settings do).
"""
import glob
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

C_DIR = "lmmetrics_c"
DEBUG = os.environ.get("LMMETRICS_DEBUG") == "1"  # keep debug info


def _flags_for(kind):
    """Per-compiler flags, all in one place: base (every unit), ISA flags by
    path, OpenMP flag sets to try in order (compile, link), and release
    flags (compile, link) that drop debug info."""
    if kind == "msvc":
        return {
            "base": ["/O2", "/std:c11", "/fp:precise"],
            "isa": {"avx2": ["/arch:AVX2"], "avx512": ["/arch:AVX512"], "neon": []},
            # LLVM's runtime: OpenMP 3.1+ (max reductions, 64-bit loop indices)
            "openmp": [(["/openmp:llvm"], [])],
            "release": ([], []),
        }
    # GCC and Clang. -fno-wrapv undoes the -fwrapv in Python's own CFLAGS,
    # which slows the streaming kernel loops by a quarter (the core relies
    # on no signed wrap). -ffp-contract=off: no a*b+c fused behind the code's
    # back. GCC's -std=c99 already means it; Clang's default fuses within a
    # statement, which made the float64 AVX2 KL of a row against itself
    # come out a rounding above 0 (the scalar and vector halves rounded
    # differently). The intrinsics' explicit FMAs are unaffected.
    flags = {
        "base": ["-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-wrapv", "-fvisibility=hidden"],
        "isa": {
            "avx2": ["-mavx2", "-mfma", "-mf16c"],
            "avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c", "-mpopcnt"],
            "neon": [],  # baseline on aarch64
        },
        "openmp": [(["-fopenmp"], ["-fopenmp"])],
        # the core: 6.3 MB with -g, 0.74 MB without (x86-64, GCC 12)
        "release": ([] if DEBUG else ["-g0"], [] if DEBUG or sys.platform == "darwin" else ["-s"]),
    }
    if sys.platform == "darwin":
        # Apple clang has no -fopenmp driver flag: the preprocessor flag and
        # libomp from Homebrew or conda when there (as scikit-learn builds)
        prefixes = [os.environ.get("LMMETRICS_LIBOMP_PREFIX"), os.environ.get("CONDA_PREFIX"),
                    "/opt/homebrew/opt/libomp", "/usr/local/opt/libomp", "/opt/local"]
        for p in prefixes:
            if p and os.path.isfile(os.path.join(p, "include", "omp.h")):
                lib = os.path.join(p, "lib")
                flags["openmp"].append((["-Xpreprocessor", "-fopenmp", "-I" + os.path.join(p, "include")],
                                        ["-L" + lib, "-lomp", "-Wl,-rpath," + lib]))
    return flags


def _try_compile(compiler, code, flags, link_flags=None):
    """True when `compiler` builds `code` with `flags` (and links it with
    `link_flags` if given)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(code)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            if link_flags is not None:
                compiler.link_executable(objs, os.path.join(tmp, "probe"), output_dir=tmp,
                                         extra_postargs=link_flags)
        except Exception:
            return False
    return True


def _macro_probe(cond):
    return "#if !(%s)\n#error no\n#endif\nint lm_probe;\n" % cond


# the compiler's target, by its predefined macros
TARGETS = {
    "x86": "defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)",
    "aarch64": "defined(__aarch64__) || defined(_M_ARM64)",
}
ISA_TARGET = {"avx2": "x86", "avx512": "x86", "neon": "aarch64"}
PROBE_OPENMP = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0?0:1;}\n"
# An ISA's probe needs both the macros its flags define and its intrinsics
# compiled without a target attribute: a flag the compiler refused or
# ignored (MSVC warns and goes on; its intrinsics need no flag) fails it.
PROBE_ISA = {
    "avx2": "#if !defined(__AVX2__) || (defined(__GNUC__) && (!defined(__FMA__) || !defined(__F16C__)))\n"
            "#error the AVX2 flags were not applied\n#endif\n"
            "#include <immintrin.h>\nint main(void){__m256 x=_mm256_fmadd_ps(_mm256_set1_ps(1),"
            "_mm256_set1_ps(2),_mm256_cvtph_ps(_mm_setzero_si128()));return (int)_mm256_cvtss_f32(x);}\n",
    "avx512": "#if !defined(__AVX512F__) || !defined(__AVX512BW__)\n#error the AVX-512 flags were not applied\n#endif\n"
              "#include <immintrin.h>\nint main(void){__m512 x=_mm512_scalef_ps(_mm512_set1_ps(1),"
              "_mm512_set1_ps(2));__m512i m=_mm512_max_epi16(_mm512_set1_epi16(1),_mm512_set1_epi16(2));"
              "return (int)_mm512_reduce_add_ps(x)+_mm512_reduce_max_epi32(m);}\n",
    "neon": "#include <arm_neon.h>\nint main(void){float32x4_t x=vfmaq_f32(vdupq_n_f32(1),vdupq_n_f32(2),"
            "vdupq_n_f32(3));uint32x4_t m=vceqq_f32(x,x);return (int)vgetq_lane_f32(vmaxq_f32(x,x),0)"
            "+(int)vmaxvq_u32(m);}\n",
}


class BuildExt(build_ext):
    def _compiler_kind(self):
        cc = self.compiler
        if cc.compiler_type == "msvc":
            return "msvc"
        if _try_compile(cc, _macro_probe("defined(__clang__)"), []):
            return "clang"
        return "gcc"

    def build_extensions(self):
        cc = self.compiler
        kind = self._compiler_kind()
        fl = _flags_for(kind)
        base, release = fl["base"], fl["release"]
        target = next((t for t, cond in TARGETS.items() if _try_compile(cc, _macro_probe(cond), base)), "other")
        cc_flags = list(base)
        link_flags = list(release[1])
        openmp = "none"
        if os.environ.get("LMMETRICS_NO_OPENMP") != "1":
            for c_fl, l_fl in fl["openmp"]:
                if _try_compile(cc, PROBE_OPENMP, base + c_fl, l_fl):
                    cc_flags += c_fl
                    link_flags += l_fl
                    openmp = " ".join(c_fl + [f for f in l_fl if f not in c_fl])
                    break
        if openmp == "none":
            self.warn("lmmetrics: the compiler has no OpenMP; building a serial core")
        isas = ["scalar"]
        objects = cc.compile([os.path.join(C_DIR, "lm_isa_scalar.c")], output_dir=self.build_temp,
                             include_dirs=[C_DIR], extra_postargs=base + release[0])
        for isa, flags in fl["isa"].items():
            if ISA_TARGET[isa] != target:
                continue
            if _try_compile(cc, PROBE_ISA[isa], base + flags):
                objects += cc.compile([os.path.join(C_DIR, f"lm_isa_{isa}.c")], output_dir=self.build_temp,
                                      include_dirs=[C_DIR], extra_postargs=base + flags + release[0])
                isas.append(isa)
            else:
                self.warn(f"lmmetrics: the compiler does not build the {isa} path; leaving it out")
        print(f"lmmetrics: {kind} compiler, target {target}, paths {' '.join(isas)}, OpenMP {openmp}")
        for ext in self.extensions:
            ext.extra_objects = objects + list(ext.extra_objects or [])
            ext.extra_compile_args = cc_flags + release[0] + list(ext.extra_compile_args or [])
            ext.extra_link_args = link_flags + list(ext.extra_link_args or [])
            ext.define_macros = list(ext.define_macros or []) + [
                (f"LM_HAVE_{isa.upper()}", "1") for isa in isas if isa != "scalar"] + [
                ("LM_CFLAGS", '"%s"' % " ".join(cc_flags)),
                ("LM_OPENMP_BUILD", '"%s"' % openmp),
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
        depends=sorted(glob.glob(os.path.join(C_DIR, "lm_*.[ch]"))),
    )
    return cythonize([ext], compiler_directives={"language_level": 3})


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
