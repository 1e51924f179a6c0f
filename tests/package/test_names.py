"""Every global name a function of the package reads is defined in its
module (or a builtin): a name imported only for type checking (``if
TYPE_CHECKING: import torch``) and read in a branch the CPU tests do not
take (a CUDA device's) is a NameError on the device alone, which neither
mypy nor a linter reports (they take the TYPE_CHECKING import as defined)."""
import builtins
import dis
import importlib
import pkgutil
import types

import lmmetrics


def _codes(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def test_every_global_name_a_function_reads_is_defined():
    undefined = []
    for info in pkgutil.walk_packages(lmmetrics.__path__, "lmmetrics."):
        if info.name.endswith("__main__"):  # (importing it runs the command line)
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # (an optional dependency absent: that module is not checked here)
            continue
        path = getattr(module, "__file__", None) or ""
        if not path.endswith(".py"):
            continue
        with open(path, encoding="utf-8") as f:
            top = compile(f.read(), path, "exec")
        for code in _codes(top):
            if code is top:  # (the module's own body defines its globals as it runs)
                continue
            for ins in dis.get_instructions(code):
                if ins.opname == "LOAD_GLOBAL" and ins.argval not in vars(module) \
                        and not hasattr(builtins, ins.argval):
                    undefined.append(f"{info.name}.{getattr(code, 'co_qualname', code.co_name)}: {ins.argval}")
    assert undefined == []
