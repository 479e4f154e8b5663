"""The house: kvdemo's modules import each other one way, down the layers of docs/architecture.md.

Every import counts, at module level or inside a function (a function-local import is still an import):
no module imports one of a higher layer, and imports inside a layer form no cycle. Every module must be
placed in a layer, so a new module is placed on purpose.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# bottom first; a module belongs to the first layer with a name equal to it or a package above it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "data",
        (
            "kvdemo",
            "kvdemo.configs",
            "kvdemo.formats",
            "kvdemo.engines",
            "kvdemo.precision",
            "kvdemo.layout",
            "kvdemo.production",
            "kvdemo.texts",
            "kvdemo.documents",
            "kvdemo.progress",
            "kvdemo.rates",
            "kvdemo.machine",
        ),
    ),
    ("results", ("kvdemo.results", "kvdemo.memory")),  # memory's headroom planner returns results.headroom.Headroom
    ("figures", ("kvdemo.figures",)),
    ("quant", ("kvdemo.quant",)),
    ("cache", ("kvdemo.codebooks", "kvdemo.cache")),
    ("attention", ("kvdemo.attention",)),
    ("models", ("kvdemo.models",)),
    ("runner", ("kvdemo.runner", "kvdemo.graphs", "kvdemo.batch", "kvdemo.llamacpp")),
    (
        "measures",
        (
            "kvdemo.calibration",
            "kvdemo.needle",
            "kvdemo.ppl",
            "kvdemo.drift",
            "kvdemo.chat",
            "kvdemo.measured",
            "kvdemo.prefill_modes",
            "kvdemo.sizes",
            "kvdemo.contest",
            "kvdemo.probe",
        ),
    ),
    ("findings", ("kvdemo.findings",)),
    ("cli", ("kvdemo.cli", "kvdemo.__main__")),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_imports(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """kvdemo module -> {kvdemo module it imports: line}, every import statement anywhere in the file."""
    mods: dict[str, dict[str, int]] = {}
    for path in sorted((root / "kvdemo").rglob("*.py")):
        name = module_name(path, root)
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from pkg import x` imports the submodule pkg.x when there is one, else a name of pkg itself
                names = [f"{module}.{a.name}" for a in node.names]
                targets = [n if _is_module(root, n) else module for n in names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.split(".")[0] == "kvdemo":
                    deps.setdefault(target, node.lineno)
        mods[name] = deps
    return {m: {d: line for d, line in deps.items() if d in mods and d != m} for m, deps in mods.items()}


def layer_of(module: str) -> int | None:
    for rank, (_, names) in enumerate(LAYERS):
        if any(module == n or (n != "kvdemo" and module.startswith(n + ".")) for n in names):
            return rank
    return None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in module_imports() if layer_of(m) is None)
    assert not unplaced, f"place these modules in a layer of tests/test_house.py and docs/architecture.md: {unplaced}"


def test_imports_run_down_the_layers():
    upward = []
    for module, deps in module_imports().items():
        for dep, line in deps.items():
            if layer_of(dep) is not None and layer_of(module) is not None and layer_of(dep) > layer_of(module):
                upward.append(
                    f"{module}:{line} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
                )
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = {m: set(deps) for m, deps in module_imports().items()}
    assert "kvdemo.layout" in graph["kvdemo.cache"]  # the parser sees the imports at all
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_function_local_imports_are_seen(tmp_path):
    """An import inside a function, relative or absolute, counts as an import (the old guard skipped them)."""
    package = tmp_path / "kvdemo"
    (package / "quant").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "quant" / "__init__.py").write_text("def f():\n    from ..runner import prefill\n")
    (package / "cache.py").write_text("import torch\n\n\ndef g():\n    import kvdemo.runner\n")
    (package / "runner.py").write_text("from .cache import g\n")
    graph = module_imports(tmp_path)
    assert graph["kvdemo.quant"] == {"kvdemo.runner": 2}
    assert graph["kvdemo.cache"] == {"kvdemo.runner": 5}
    assert graph["kvdemo.runner"] == {"kvdemo.cache": 1}
