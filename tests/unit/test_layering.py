"""Imports inside prime_spmd point one way, down the layers below (docs/architecture.md, "Layers").

Every module's imports are parsed with ``ast`` (function-local and ``TYPE_CHECKING`` imports included). A module
belongs to the unit it sits in (a sub-package, or a top-level module of ``prime_spmd``); the top-level ``kernels/``
folder is the ``kernels`` unit (it is imported as ``prime_spmd.kernels``). A unit may import units of its own layer
or lower ones, never a higher one, and the graph between units has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# layer of each unit: 0 leaves, 1 parallelism/models/kernels, 2 engine/weights/environments/data, 3 the trainer,
# 4 the RL loop, 5 entry points
LAYERS = {
    "__init__": 0,
    "config": 0,
    "log": 0,
    "progress": 0,
    "metrics": 0,
    "plots": 0,
    "distributed": 1,
    "models": 1,
    "kernels": 1,
    "inference": 2,
    "sync": 2,
    "envs": 2,
    "data": 2,
    "memory": 2,  # the device-memory plan: counts a model's parameters with our model code (models/)
    "trainer": 3,
    "rl": 4,
    "__main__": 5,
    "eval": 5,
}


def _module_name(path: Path) -> str:
    """Dotted name of a source file: prime_spmd/... as itself, kernels/... as prime_spmd.kernels...."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts = ["prime_spmd", *parts]
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str | None:
    """The unit of a dotted module name inside prime_spmd, None outside it."""
    parts = module.split(".")
    if parts[0] != "prime_spmd":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dotted name) of every import in the file; ``from a import b`` yields a.b (b may be a
    module), relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
    return out


def _sources() -> list[Path]:
    files = sorted((ROOT / "prime_spmd").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def _edges() -> list[tuple[str, str, str, int, str]]:
    """(from unit, to unit, file, line, imported name) of every import between two units."""
    edges = []
    for path in _sources():
        src = _unit(_module_name(path))
        for line, name in _imports(path):
            dst = _unit(name)
            if dst is not None and dst != src:
                edges.append((src, dst, str(path.relative_to(ROOT)), line, name))
    return edges


def check_layering(edges: list[tuple[str, str, str, int, str]]) -> list[str]:
    """Messages for every unit without a layer, every upward import and every cycle between units."""
    problems = []
    units = {e[0] for e in edges} | {e[1] for e in edges}
    for u in sorted(units - LAYERS.keys()):
        problems.append(f"unit prime_spmd.{u} has no layer: add it to LAYERS in tests/unit/test_layering.py")
    for src, dst, file, line, name in edges:
        if src in LAYERS and dst in LAYERS and LAYERS[dst] > LAYERS[src]:
            problems.append(
                f"{file}:{line}: `{name}` points upward ({src}, layer {LAYERS[src]} -> {dst}, layer {LAYERS[dst]})"
            )
    graph: dict[str, dict[str, tuple[str, int, str]]] = {}
    for src, dst, file, line, name in edges:
        graph.setdefault(src, {}).setdefault(dst, (file, line, name))
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 done
    stack: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == 1:
                cycle = stack[stack.index(v) :] + [v]
                hops = [f"{a} -> {b} ({'{}:{}: `{}`'.format(*graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
                problems.append("import cycle between units: " + "; ".join(hops))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return problems


def test_imports_point_down_and_form_no_cycle() -> None:
    edges = _edges()
    assert len(_sources()) > 50 and edges, "no sources found: the test no longer sees the package"
    problems = check_layering(edges)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_check_layering_names_the_file_and_import() -> None:
    """The checker itself: an upward import and a cycle are reported with their file and import."""
    upward = [("data", "trainer", "prime_spmd/data/x.py", 3, "prime_spmd.trainer.packing.Sample")]
    (msg,) = check_layering(upward)
    assert "prime_spmd/data/x.py:3" in msg and "prime_spmd.trainer.packing.Sample" in msg and "upward" in msg
    cycle = [
        ("inference", "sync", "prime_spmd/inference/a.py", 1, "prime_spmd.sync.weights"),
        ("sync", "inference", "prime_spmd/sync/b.py", 2, "prime_spmd.inference.engine"),
    ]
    (msg,) = check_layering(cycle)
    assert "cycle" in msg and "prime_spmd/sync/b.py:2" in msg and "prime_spmd/inference/a.py:1" in msg
    assert check_layering([("nowhere", "config", "prime_spmd/nowhere.py", 1, "prime_spmd.config")])
