"""Build and run-time configuration of the native core."""
from __future__ import annotations

import os
from typing import Dict, List, Union

from .. import _core
from .._version import __version__

ENV_ISA = "LMMETRICS_ISA"

#: a configuration entry: a name, a flag, a count or a list of names
ConfigValue = Union[str, bool, int, List[str]]


def apply_env_isa() -> None:
    """Honour LMMETRICS_ISA=avx512|avx2|scalar (forces a SIMD path)."""
    name = os.environ.get(ENV_ISA, "").strip().lower()
    if name:
        try:
            _core.set_isa(name)
        except ValueError as e:
            raise RuntimeError(f"{ENV_ISA}={name}: {e}") from None


def config() -> Dict[str, ConfigValue]:
    return {
        "version": __version__,
        "isa": _core.active_isa(),
        "isa_best": _core.best_isa(),
        "isas_built": list(_core.ISAS_BUILT),
        "isas_supported": [i for i in _core.ISAS if _core.isa_supported(i)],
        "openmp": _core.openmp(),
        "threads": _core.max_threads(),
        "cflags": _core.CFLAGS,
        "openmp_build": getattr(_core, "OPENMP_BUILD", "unknown"),
    }


def show_config(print_out: bool = True) -> Dict[str, ConfigValue]:
    """Print (and return) the version, the SIMD path in use, OpenMP and its
    default thread count, and the compiler flags the core was built with."""
    cfg = config()
    if print_out:
        width = max(len(k) for k in cfg)
        for k, v in cfg.items():
            if isinstance(v, list):
                v = ", ".join(v)
            elif isinstance(v, bool):
                v = "on" if v else "off"
            print(f"{k:<{width}}  {v}")
    return cfg
