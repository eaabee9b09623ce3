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
from spade_jax.envs.contract import (
    MATH_VERIFY_NAMES,
    RECIPE_SCORED,
    REFERENCE_IMPLICIT_NAMES,
    REFERENCE_IMPORTS,
    TOOL_CLASS,
    parse_program,
    resolve_contract,
)
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
# Attribute names refused on any object: the ways out of the import allow-list that the
# allowed modules carry (`statistics.sys`, `typing.sys`, numpy's ctypes bridges and file
# I/O on arrays).
FORBIDDEN_ATTRIBUTES: frozenset[str] = frozenset(
    {"os", "sys", "subprocess", "builtins", "importlib", "ctypes", "ctypeslib", "tofile",
     "fromfile", "memmap", "open_memmap", "dump"}
)  # fmt: skip
# numpy names refused after `np.` / `numpy.` (file I/O, compilers, test runners, config).
FORBIDDEN_NUMPY_NAMES: frozenset[str] = frozenset(
    {"load", "save", "savez", "savez_compressed", "loadtxt", "savetxt", "genfromtxt",
     "fromregex", "DataSource", "lib", "f2py", "distutils", "testing", "show_config",
     "show_runtime", "get_include", "__config__"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GateResult:
    error: SandboxError | None
    tree: ast.Module | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def check_source(source: str, config: SandboxConfig, contract: str = "paper") -> GateResult:
    """Runs every static check; the first failure wins.

    `contract` is "paper" (`class Environment`, imports from `config.allowed_imports`) or
    "reference" (a `*Env` class; `config.reference_imports` importable too, within the
    numpy / math_verify rules below), or "auto" (detected from the source).
    """
    if not isinstance(source, str):
        raise TypeError(f"program source must be str, got {type(source).__name__}")
    kind = resolve_contract(contract, source)
    reference = kind in RECIPE_SCORED
    allowed = config.allowed_imports | (config.reference_imports if reference else frozenset())
    if kind == "reference_tool_use":  # the recipe's base class may be imported by name
        allowed = allowed | {"tool_use_base_env"}
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > config.max_source_bytes:
        return GateResult(
            SandboxError("source_too_large", f"{size} bytes > cap {config.max_source_bytes}")
        )
    try:
        tree = parse_program(source, filename="<environment>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return GateResult(SandboxError("syntax_error", f"{type(err).__name__}: {err}"))
    nodes = list(ast.walk(tree))
    if len(nodes) > config.max_ast_nodes:
        return GateResult(
            SandboxError("source_too_large", f"{len(nodes)} AST nodes > cap {config.max_ast_nodes}")
        )
    modules = _module_aliases(tree, reference)
    for node in nodes:
        error = _check_node(node, allowed) or _check_module_use(node, modules)
        if error is not None:
            line = getattr(node, "lineno", "?")
            return GateResult(SandboxError(error.code, f"line {line}: {error.detail}"))
    if kind == "tool":
        return GateResult(_check_contract(tree, TOOL_CLASS, ("reset", "check")), tree)
    return GateResult(_check_reference(tree) if reference else _check_contract(tree), tree)


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
    elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
        return SandboxError("forbidden_attribute", node.attr)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _ATTRIBUTE_FUNCTIONS
    ):
        for arg in node.args[1:2]:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if (_is_dunder(name) and name not in SAFE_DUNDERS) or name in FORBIDDEN_ATTRIBUTES:
                    return SandboxError("forbidden_attribute", f"{node.func.id}(.., {name!r})")
    return None


def _module_aliases(tree: ast.Module, reference: bool) -> dict[str, str]:
    """Local name -> top-level module for every `import m` / `import m as x` in the program,
    plus the reference contract's import-free module names (`np`, `random`, ...)."""
    aliases = {}
    if reference:
        aliases.update({n: t for n, t in REFERENCE_IMPLICIT_NAMES.items() if ":" not in t})
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
    return {name: target.split(".")[0] for name, target in aliases.items()}


def _module_rule(module: str, name: str) -> SandboxError | None:
    """Is `name`, read from the module `module`, refused?"""
    if name == "*" and module in REFERENCE_IMPORTS:  # would bind np.load etc. as bare names
        return SandboxError("forbidden_import", f"from {module} import *")
    if name.startswith("_"):  # module internals: `random._os`, `collections._sys`, ...
        return SandboxError("forbidden_attribute", f"{module}.{name}")
    if module == "numpy" and name in FORBIDDEN_NUMPY_NAMES:
        return SandboxError("forbidden_attribute", f"numpy.{name}")
    if module == "math_verify" and name not in MATH_VERIFY_NAMES:
        return SandboxError(
            "forbidden_attribute", f"math_verify.{name} (only {sorted(MATH_VERIFY_NAMES)})"
        )
    return None


def _check_module_use(node: ast.AST, modules: dict[str, str]) -> SandboxError | None:
    """Refuses module internals and the numpy / math_verify names that reach files,
    compilers or string evaluators, whether reached as `np.load`, `from numpy import
    load` or `import numpy.lib`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        module = modules.get(node.value.id)
        if module is not None:
            return _module_rule(module, node.attr)
    elif (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in _ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
    ):  # fmt: skip
        return _module_rule(modules[node.args[0].id], node.args[1].value)
    elif isinstance(node, ast.ImportFrom) and node.module:
        parts = node.module.split(".")
        for depth in range(1, len(parts)):
            error = _module_rule(parts[0], parts[depth])
            if error is not None:
                return error
        if len(parts) > 1 and parts[0] == "math_verify":
            return SandboxError("forbidden_import", f"from {node.module} import")
        for alias in node.names:
            error = _module_rule(parts[-1] if len(parts) == 1 else parts[0], alias.name)
            if error is not None:
                return error
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            for depth in range(1, len(parts)):
                error = _module_rule(parts[0], parts[depth])
                if error is not None:
                    return error
    return None


def _check_reference(tree: ast.Module) -> SandboxError | None:
    """A reference program needs a top-level class named `*Env` that defines reset() and
    step() or inherits (the worker picks the class at load time)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Env"):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if node.bases or {"reset", "step"} <= methods:
                return None
    return SandboxError(
        "missing_contract", "no top-level class whose name ends in Env with reset() and step()"
    )


def _check_contract(tree: ast.Module, name: str = "Environment",
                    needed: tuple[str, ...] = ("reset", "step")) -> SandboxError | None:
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not classes:
        return SandboxError("missing_contract", f"no top-level `class {name}`")
    environment = classes[-1]
    if environment.bases:
        return None  # methods may be inherited; the worker checks them at load time
    methods = {
        n.name for n in environment.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    missing = [m for m in needed if m not in methods]
    if missing:
        return SandboxError("missing_contract", f"{name} lacks {', '.join(missing)}()")
    return None
