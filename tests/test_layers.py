"""The layers' arrows run one way, read from the source's imports (function-level ones too).

agentkv core (errors, keys, wire, ids, units, addresses, layers, flags, planner, tether, stubs)
  <- RPC plumbing (agentkv.rpc, .auth, .channels, .security, .serving, .launch)
  <- cache_store/ and client/ (neither imports the other)
  <- inference_worker/ and gateway/ (services: neither imports the other, nor the store)
  <- the CLI (agentkv.cli), which nothing imports
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agentkv", "cache_store", "client", "gateway", "inference_worker")
FOLDERS = {"client": "agentkv.client", "gateway": "agentkv.gateway"}  # folder: import name
PLUMBING = {
    "agentkv.rpc",
    "agentkv.auth",
    "agentkv.channels",
    "agentkv.security",
    "agentkv.serving",
    "agentkv.launch",
}
SERVICES = {"cache_store", "inference_worker", "agentkv.gateway"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[0] in FOLDERS:  # the SDK's and gateway's folders: agentkv.client, ...
                parts = (*FOLDERS[parts[0]].split("."), *parts[1:])
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def layer(module: str) -> int:
    if module == "agentkv.cli":
        return 4
    if module.startswith(("inference_worker", "agentkv.gateway")):
        return 3
    if module.startswith(("cache_store", "agentkv.client")):
        return 2
    return 1 if module in PLUMBING else 0


def package(module: str) -> str:
    for name in FOLDERS.values():
        if module.startswith(name):
            return name
    return module.split(".")[0]


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, resolving `from package import module`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_no_import_runs_upward_or_across_services():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            if package(target) == package(module) and layer(target) == layer(module):
                continue  # within one package
            services = {package(module), package(target)}
            other_service = len(services) == 2 and services <= SERVICES
            if layer(target) > layer(module) or layer(target) == layer(module) > 0 or other_service:
                wrong.append(f"{module} (layer {layer(module)}) imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_nothing_imports_the_cli():
    assert not [m for m, targets in graph().items() if "agentkv.cli" in targets]


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (circle := visit(module)):
            raise AssertionError("import circle: " + " -> ".join(circle))


def test_the_sdk_is_imported_only_by_its_collision_free_name():
    """`client` alone would be shadowed by any module of that name in a user's project."""
    plain = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            plain += [f"{module}: {n}" for n in names if n == "client" or n.startswith("client.")]
    assert not plain, "\n".join(plain)
