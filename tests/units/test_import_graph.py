"""kvlm's imports point one way: no module imports itself back through others, no package does, and no package
imports one above it in LAYERS. Counted are the imports that run, at a module's top or inside its functions (a
function's import runs when it is called, so it closes a circle as surely); imports under `if TYPE_CHECKING:` are
annotations only and aside. Read from the source with ast, nothing imported."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvlm"  # the repository's, from tests/units/

# From the bottom up: a package may import its own layer's and those below (never one above). Top-level modules
# count as packages of their own.
LAYERS = (
    ("kvlm.core", "kvlm.home", "kvlm.startup"),  # configuration, families' record, RoPE, batches, errors
    ("kvlm.kernels", "kvlm.memory"),
    ("kvlm.model", "kvlm.families", "kvlm.parallel"),
    ("kvlm.text",),  # tokenizers and chat templates
    ("kvlm.loader", "kvlm.structured", "kvlm.tool_calls"),
    ("kvlm.sampling",),
    ("kvlm.runtime",),  # context, generate, perplexity
    ("kvlm.speculative",),
    ("kvlm.engine",),
    ("kvlm.server",),
    ("kvlm.cli", "kvlm"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _imported_names(module: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package upwards
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def imports_of(module: str) -> set[str]:
    """The kvlm modules `module` imports when it runs (its own name aside)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                for branch in child.orelse:
                    visit(branch)
                continue
            found.update(_imported_names(module, child))
            visit(child)

    visit(ast.parse(MODULES[module].read_text()))
    resolved = set()
    for name in found:
        while name and name not in MODULES:  # `from package import name`: the package, unless name is a module
            name = name.rpartition(".")[0]
        if name.startswith("kvlm") and name != module:
            resolved.add(name)
    return resolved


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while component[-1:] != [node]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


MODULE_GRAPH = {module: imports_of(module) for module in MODULES}
PACKAGE_GRAPH: dict[str, set[str]] = defaultdict(set)
for _module, _imports in MODULE_GRAPH.items():
    PACKAGE_GRAPH[package_of(_module)].update(package_of(name) for name in _imports
                                               if package_of(name) != package_of(_module))


def test_no_module_imports_itself_back():
    assert circles(MODULE_GRAPH) == []


def test_no_package_imports_itself_back():
    assert circles(PACKAGE_GRAPH) == []


def test_every_package_has_a_layer():
    layered = {name for layer in LAYERS for name in layer}
    assert set(PACKAGE_GRAPH) | {package_of(m) for m in MODULES} <= layered


def test_no_package_imports_one_above_it():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [f"{module} -> {name}" for module, imports in sorted(MODULE_GRAPH.items()) for name in sorted(imports)
              if rank[package_of(name)] > rank[package_of(module)]]
    assert upward == []


def test_the_core_imports_nothing_else_of_kvlm():
    outside = {f"{m} -> {name}" for m, imports in MODULE_GRAPH.items() if package_of(m) == "kvlm.core"
               for name in imports if package_of(name) != "kvlm.core"}
    assert outside == set()


def test_a_circle_is_found():
    """The checker itself: a circle of three and a self-contained pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set(), "f": {"g"}, "g": {"f"}}
    assert circles(graph) == [["a", "b", "c"], ["f", "g"]]
