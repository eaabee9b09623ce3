"""The package's import structure, read from the source (AST; nothing is imported):

* no module imports a private name (``_x``) of another module, neither with
  ``from spade_jax.m import _x`` nor as ``m._x`` through an imported module;
* the module import graph has no cycles (lazy imports inside functions included);
* no module imports one of a higher layer (``LAYERS``, lowest first), without exception;
* no function in ``spade/`` or ``aot/`` is longer than ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "spade_jax"

# Top-level modules / subpackages of spade_jax by layer, lowest first. A module may import
# its own layer and the layers below it.
LAYERS: tuple[frozenset[str], ...] = (
    # foundations: no model, no RL
    frozenset({"seeding", "sharding", "distributed", "storage", "metrics", "plot",
               "compare", "overrides", "checkpoint", "preemption"}),
    frozenset({"models", "tokenizers"}),
    frozenset({"rollout", "envs"}),
    frozenset({"rl", "evaluation", "steering"}),
    frozenset({"spade"}),
    # composition: experiments configure every layer below; the hint filter runs SPADE's
    # designer over evaluation tasks; the toy world builds a run's warm start and evaluation
    frozenset({"experiment", "hint_filter", "toy"}),
    # entry points (and the package itself)
    frozenset({"", "train", "evaluate", "steer", "filter", "convert", "aot", "export", "run",
               "planted_faults"}),
)

# The packages held to short functions (issue 21), and how short.
SHORT_FUNCTION_PACKAGES = ("spade", "aot")
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (resolving relative imports)."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported spade_jax module, name or "", line) for every import in ``module``."""
    out = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names
                    if a.name.split(".")[0] == "spade_jax"]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] != "spade_jax":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.append((sub, "", node.lineno) if sub in MODULES
                           else (source, a.name, node.lineno))
    return out


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"spade_jax.{top} is in no layer: add it to LAYERS in {__file__}")


def test_no_module_imports_a_private_name_of_another():
    found = []
    for module, tree in TREES.items():
        aliases: dict[str, str] = {}  # local name -> spade_jax module
        for target, name, line in _imports(module):
            if name.startswith("_") and not name.startswith("__") and target != module:
                found.append(f"{module}:{line} imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("spade_jax") and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                for a in node.names:
                    if f"{source}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not found, "private names used across modules:\n" + "\n".join(found)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module in MODULES:
        for target, _, _ in _imports(module):
            while target not in MODULES:  # "spade_jax.a.b" of a name in a package
                target = target.rsplit(".", 1)[0]
            if target != module:
                graph[module].add(target)
    return graph


def test_import_graph_has_no_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [module, target]))
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [])
    # A package's __init__ importing its own submodules, which import the package's other
    # submodules through it, is how packages are built; only cycles through two files count.
    real = [c for c in cycles if len(set(c.split(" -> "))) > 1]
    assert not real, "import cycles:\n" + "\n".join(real)


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, targets in _graph().items():
        for target in sorted(targets):
            if _layer(target) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) imports {target} "
                              f"(layer {_layer(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, expected", [
    ("from spade_jax.rollout.sampler import _prefill\n", "imports spade_jax.rollout.sampler._prefill"),
    ("from spade_jax.rollout import sampler as s\ns._decode_step\n",
     "uses spade_jax.rollout.sampler._decode_step"),
])
def test_the_private_name_scan_finds_what_it_should(source, expected, monkeypatch):
    """The scan itself, on a planted module: it must report both forms."""
    monkeypatch.setitem(MODULES, "spade_jax.planted", PACKAGE / "planted.py")
    monkeypatch.setitem(TREES, "spade_jax.planted", ast.parse(source))
    with pytest.raises(AssertionError, match=expected.replace(".", r"\.")):
        test_no_module_imports_a_private_name_of_another()


def test_the_layer_check_finds_an_upward_import(monkeypatch):
    monkeypatch.setitem(MODULES, "spade_jax.models.planted", PACKAGE / "models" / "planted.py")
    monkeypatch.setitem(TREES, "spade_jax.models.planted",
                        ast.parse("from spade_jax.rl import train_step\n"))
    with pytest.raises(AssertionError, match="spade_jax.models.planted .layer 1. imports "
                                             "spade_jax.rl.train_step"):
        test_no_module_imports_a_higher_layer()


def _long_functions(modules: dict[str, ast.Module], packages: tuple[str, ...],
                    limit: int) -> list[str]:
    """``module:line name (n lines)`` for every function or method (nested ones included)
    of ``spade_jax.<package>`` longer than ``limit`` lines, from ``def`` to its last line."""
    found = []
    for module, tree in modules.items():
        if module.split(".")[1:2] not in ([p] for p in packages):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{module}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_spade_or_aot_is_over_80_lines():
    long = _long_functions(TREES, SHORT_FUNCTION_PACKAGES, MAX_FUNCTION_LINES)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                      "helpers):\n" + "\n".join(long))


def test_the_length_check_finds_a_long_function():
    def function(name: str, lines: int, indent: str = "") -> str:  # ``def`` line included
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n"
                                                    for i in range(lines - 1))

    limit = MAX_FUNCTION_LINES
    planted = {"spade_jax.spade.planted": ast.parse(function("too_long", limit + 1)),
               "spade_jax.aot.planted": ast.parse("class A:\n" + function("fits", limit, "    ")
                                                  + function("method_too_long", limit + 1, "    ")),
               "spade_jax.models.planted": ast.parse(function("elsewhere", limit + 1))}
    assert _long_functions(planted, SHORT_FUNCTION_PACKAGES, limit) == [
        f"spade_jax.spade.planted:1 too_long ({limit + 1} lines)",
        f"spade_jax.aot.planted:{limit + 2} method_too_long ({limit + 1} lines)"]
