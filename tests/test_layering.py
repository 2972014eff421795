"""The layers of src/folio, checked from the imports themselves (every import
statement, at module level or inside a function, parsed with ast):

- no import cycle anywhere;
- config.py imports nothing of model/ or worker/ (building a config from a
  checkpoint lives a floor up, in engine/);
- core/ (scheduling, blocks) imports no torch;
- server/ imports nothing of model/ or worker/: it talks to the engine client;
- distributed/ (tensor-parallel state) imports nothing of model/, worker/ or
  engine/, so that the layers can use it.
"""

import ast
from pathlib import Path

import folio

SRC = Path(folio.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> every module name it imports (absolute, as written or resolved)."""
    graph = {}
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = found
    return graph


GRAPH = _imports()


def _internal(targets: set[str]) -> set[str]:
    return {t for t in targets if t in GRAPH}


def test_the_graph_is_read():
    assert "folio.engine.llm_engine" in GRAPH and "folio.config" in GRAPH["folio.engine.llm_engine"]


def test_no_import_cycle():
    edges = {m: _internal(t) - {m} for m, t in GRAPH.items()}
    # a package's __init__ importing its own submodules is not a cycle of layers
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and t in edges)}
             for m, ts in edges.items()}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _bad(prefix: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for m, targets in GRAPH.items():
        if m != prefix and not m.startswith(prefix + "."):
            continue
        hits = sorted(t for t in targets
                      if any(t == b or t.startswith(b + ".") for b in banned))
        if hits:
            out[m] = hits
    return out


def test_config_imports_nothing_of_model_or_worker():
    assert not _bad("folio.config", ("folio.model", "folio.worker"))


def test_core_imports_no_torch():
    assert not _bad("folio.core", ("torch", "folio.model", "folio.worker"))


def test_server_imports_nothing_of_model_or_worker():
    assert not _bad("folio.server", ("folio.model", "folio.worker"))


def test_distributed_sits_below_the_layers():
    assert not _bad("folio.distributed", ("folio.model", "folio.worker", "folio.engine"))
