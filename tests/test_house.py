"""The house: kvdemo's modules import each other one way (no cycles at module level)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_imports() -> dict[str, set[str]]:
    """kvdemo module -> the kvdemo modules it imports at module level (imports inside functions are lazy)."""
    mods: dict[str, set[str]] = {}
    for path in (ROOT / "kvdemo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvdemo"):
                deps.add(node.module)
        mods[name] = deps - {name}
    return {m: {d for d in deps if d in mods} for m, deps in mods.items()}


def test_no_import_cycles():
    graph = module_imports()
    assert "kvdemo.cache" in graph and "kvdemo.layout" in graph["kvdemo.cache"]
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
