"""The package's layers, from its imports: every module of the installed
``lmmetrics`` (function-level imports included) imports only modules of its
own layer or of those below it, the imports form no cycle, and nothing but
the entry points imports the command line. A new module joins a layer here
(``src/lmmetrics/README.md`` describes them)."""
import ast
import os
import pathlib

import lmmetrics

# top to bottom: a module imports from its own layer and those below it only
LAYERS = [
    ("command line", ["lmmetrics.__main__", "lmmetrics.cli", "lmmetrics.cli.*"]),
    ("public names", ["lmmetrics"]),
    ("integrations", ["lmmetrics.torchmetrics", "lmmetrics.transformers", "lmmetrics.lm_eval"]),
    ("public modules", ["lmmetrics.text", "lmmetrics.evaluation", "lmmetrics.comparison", "lmmetrics.windows", "lmmetrics.ranking",
                        "lmmetrics.metrics", "lmmetrics.documents", "lmmetrics.tokens", "lmmetrics.convert",
                        "lmmetrics.probs", "lmmetrics._spread"]),
    ("engine: run", ["lmmetrics._engine"]),
    ("engine: lazy-logits loop", ["lmmetrics._engine.chunked"]),
    ("engine: backend choice", ["lmmetrics._engine.backend"]),
    ("engine: backends", ["lmmetrics._engine.cuda", "lmmetrics._engine.native"]),
    ("engine: GPU kernels", ["lmmetrics._engine.cuda.torch_path", "lmmetrics._engine.cuda.triton"]),
    ("engine: GPU result buffer", ["lmmetrics._engine.cuda.layout"]),
    ("engine: outputs", ["lmmetrics._engine.request"]),
    ("engine: inputs", ["lmmetrics._engine.inputs"]),
    ("engine: lazy logits", ["lmmetrics._engine.lazy"]),
    ("engine: leaves", ["lmmetrics._engine.checks", "lmmetrics._engine.errors", "lmmetrics._engine.types",
                        "lmmetrics._engine.device", "lmmetrics._engine.config"]),
    ("compiled core", ["lmmetrics._core", "lmmetrics._version"]),
]
ROOT = pathlib.Path(lmmetrics.__file__).parent


def _modules():
    """{dotted name: path} of every module of the installed package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()
KNOWN = set(MODULES) | {"lmmetrics._core"}


def _layer(name):
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if name == m or (m.endswith(".*") and name.startswith(m[:-1])):
                return i
    raise AssertionError(f"{name} is in no layer of tests/package/test_layers.py: add it to one")


def _imports(name, path):
    """The lmmetrics modules name imports (at any depth of its code)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "lmmetrics"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "lmmetrics":
                continue
            for a in node.names:  # from X import Y: the module X.Y where there is one, else X
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in KNOWN else mod)
    return {m for m in out if m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_point_down_the_layers():
    up = [f"{a} (layer {LAYERS[_layer(a)][0]!r}) imports {b} (layer {LAYERS[_layer(b)][0]!r})"
          for a, targets in GRAPH.items() for b in targets if b in KNOWN and _layer(b) < _layer(a)]
    assert not up, "\n".join(up)


def test_no_import_cycle():
    state = {}

    def visit(a, stack):
        state[a] = "open"
        for b in sorted(GRAPH.get(a, ())):
            if state.get(b) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(b):] + [b]))
            if b not in state:
                visit(b, stack + [b])
        state[a] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_nothing_in_the_library_imports_the_command_line():
    cli = [a for a, targets in GRAPH.items() if _layer(a) > 0 and any(_layer(b) == 0 for b in targets if b in KNOWN)]
    assert not cli, cli


def test_the_gpu_kernels_know_only_the_buffer_layout_of_the_cuda_path():
    """torch_path and triton import neither the CUDA path's choice
    (cuda/__init__) nor each other: what they share is layout."""
    for name in ("lmmetrics._engine.cuda.torch_path", "lmmetrics._engine.cuda.triton"):
        assert not GRAPH[name] & {"lmmetrics._engine.cuda", "lmmetrics._engine.cuda.torch_path",
                                  "lmmetrics._engine.cuda.triton"}, name


def test_the_walk_sees_function_level_imports():
    # (_engine.cuda imports triton inside a function only)
    assert "lmmetrics._engine.cuda.triton" in GRAPH["lmmetrics._engine.cuda"]
    assert "lmmetrics.cli.bench.cpu" in GRAPH["lmmetrics.cli"]


def test_tile_flags_are_the_low_bits_in_order():
    """The Triton tiles pack their flags as bit b from count field b."""
    from lmmetrics._engine.cuda import layout

    assert layout.SPAN_FLAGS == tuple(1 << b for b in range(len(layout.SPAN_FLAGS)))
    flags = [getattr(layout, n) for n in dir(layout) if n.startswith("F_")]
    assert sorted(flags) == [1 << b for b in range(len(flags))]  # one bit each


def test_the_outputs_are_one_list():
    """OUTPUTS, RowResults' fields, the typed names and the GPU buffer's rows
    agree (a new output joins request._OUTPUT_DTYPES and RowResults)."""
    import dataclasses
    import typing

    from lmmetrics._engine import request
    from lmmetrics._engine.cuda import layout

    fields = [f.name for f in dataclasses.fields(request.RowResults)]
    assert [f for f in fields if f in request.OUTPUTS] == list(request.OUTPUTS)
    assert set(typing.get_args(request.FloatOutput)) | set(typing.get_args(request.IndexOutput)) == set(request.OUTPUTS)
    assert set(typing.get_args(request.IndexOutput)) == set(request.INDEX_OUTPUTS)
    # the GPU result buffer: the flags, each output, the targets
    assert layout.N_RESULTS == 2 + len(request.OUTPUTS) and layout.RES_TARGETS == layout.N_RESULTS - 1
    assert sorted([layout.RES_FLAGS, layout.RES_TARGETS] + [layout.row(n) for n in request.OUTPUTS]) == \
        list(range(layout.N_RESULTS))
    assert os.path.basename(request.__file__) == "request.py"
