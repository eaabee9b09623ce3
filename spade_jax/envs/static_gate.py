"""The static gate: cheap checks on program source before any process runs it.

A filter, not the boundary: it turns away the obvious (oversized source, syntax errors,
imports outside the allow-list, eval/exec/open, dunder walks such as
`().__class__.__base__.__subclasses__()`) with a precise reason code, so most bad programs
never cost a worker. Anything that slips past it is still contained by the sandbox layers.
"""

from __future__ import annotations

import ast
import dataclasses

from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.results import SandboxError

FORBIDDEN_NAMES: frozenset[str] = frozenset(
    {
        "eval", "exec", "compile", "__import__", "open", "input", "breakpoint", "globals",
        "locals", "vars", "memoryview", "help", "exit", "quit", "__builtins__", "__loader__",
        "__spec__",
    }
)  # fmt: skip
# Dunder attributes an environment legitimately touches; every other `x.__y__` is refused.
SAFE_DUNDERS: frozenset[str] = frozenset(
    {"__init__", "__name__", "__doc__", "__len__", "__str__", "__repr__", "__eq__", "__hash__"}
)
_ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})


@dataclasses.dataclass(frozen=True)
class GateResult:
    error: SandboxError | None
    tree: ast.Module | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def check_source(source: str, config: SandboxConfig) -> GateResult:
    """Runs every static check; the first failure wins."""
    if not isinstance(source, str):
        raise TypeError(f"program source must be str, got {type(source).__name__}")
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > config.max_source_bytes:
        return GateResult(
            SandboxError("source_too_large", f"{size} bytes > cap {config.max_source_bytes}")
        )
    try:
        tree = ast.parse(source, filename="<environment>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return GateResult(SandboxError("syntax_error", f"{type(err).__name__}: {err}"))
    nodes = list(ast.walk(tree))
    if len(nodes) > config.max_ast_nodes:
        return GateResult(
            SandboxError("source_too_large", f"{len(nodes)} AST nodes > cap {config.max_ast_nodes}")
        )
    for node in nodes:
        error = _check_node(node, config.allowed_imports)
        if error is not None:
            line = getattr(node, "lineno", "?")
            return GateResult(SandboxError(error.code, f"line {line}: {error.detail}"))
    return GateResult(_check_contract(tree), tree)


def _check_node(node: ast.AST, allowed_imports: frozenset[str]) -> SandboxError | None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] not in allowed_imports:
                return SandboxError("forbidden_import", f"import {alias.name}")
    elif isinstance(node, ast.ImportFrom):
        if node.level or (node.module or "").split(".")[0] not in allowed_imports:
            return SandboxError("forbidden_import", f"from {'.' * node.level}{node.module} import")
    elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
        return SandboxError("forbidden_name", node.id)
    elif isinstance(node, ast.Attribute) and _is_dunder(node.attr):
        if node.attr not in SAFE_DUNDERS:
            return SandboxError("forbidden_attribute", node.attr)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _ATTRIBUTE_FUNCTIONS
    ):
        for arg in node.args[1:2]:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if _is_dunder(arg.value) and arg.value not in SAFE_DUNDERS:
                    return SandboxError("forbidden_attribute", f"{node.func.id}(.., {arg.value!r})")
    return None


def _check_contract(tree: ast.Module) -> SandboxError | None:
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Environment"]
    if not classes:
        return SandboxError("missing_contract", "no top-level `class Environment`")
    environment = classes[-1]
    if environment.bases:
        return None  # methods may be inherited; the worker checks them at load time
    methods = {
        n.name for n in environment.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    missing = [m for m in ("reset", "step") if m not in methods]
    if missing:
        return SandboxError("missing_contract", f"Environment lacks {', '.join(missing)}()")
    return None
