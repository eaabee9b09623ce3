"""Writes scripts/constraints-tpu.txt: the versions installed here of every distribution a
TPU install resolves (spade_jax's runtime dependencies and jax[tpu], transitively).

    python scripts/pin_constraints.py            # after `pip install -e .[tpu]` and the tests

`scripts/install.sh --tpu` passes the file to pip with `-c`, so every worker of a slice gets
the versions the test suite passed with here. Markers for other platforms and Python < 3.11
are dropped; extras are followed only where a requirement names them.
"""

from __future__ import annotations

import platform
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parent / "constraints-tpu.txt"
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(marker: str, extras: set[str]) -> bool:
    """A rough marker check for Linux x86_64, CPython >= 3.11."""
    wanted = set(re.findall(r'extra\s*==\s*["\']([^"\']+)["\']', marker))
    if wanted and not wanted & extras:
        return False
    if re.search(r'sys_platform\s*==\s*["\'](win32|darwin|cygwin)', marker):
        return False
    old = re.findall(r'python_version\s*<=?\s*["\'](\d+)\.(\d+)', marker)
    return not any((int(a), int(b)) <= (3, 10) for a, b in old)


def closure(requirements: list[str]) -> dict[str, str]:
    """Installed name -> version of every distribution the requirements pull in."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        match = _NAME.match(todo.pop())
        name, extras = match.group(1), frozenset(
            e.strip() for e in (match.group(2) or "").split(",") if e.strip())
        if (_key(name), extras) in seen:
            continue
        seen.add((_key(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        pins[_key(name)] = dist.version
        for text in dist.requires or ():
            requirement, _, marker = text.partition(";")
            if _applies(marker, set(extras)):
                todo.append(requirement)
    return pins


def main() -> None:
    project = tomllib.loads((OUT.parents[1] / "pyproject.toml").read_text())["project"]
    pins = closure(project["dependencies"] + project["optional-dependencies"]["tpu"])
    pins.pop("spade-jax", None)
    header = [
        "# Tested versions for `scripts/install.sh --tpu` (pip -c): written by",
        "# scripts/pin_constraints.py from the environment the test suite passed in",
        f"# (Python {platform.python_version()}, {sys.platform} {platform.machine()}).",
    ]
    OUT.write_text("\n".join(header + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n")
    print(f"wrote {len(pins)} pins to {OUT}")


if __name__ == "__main__":
    main()
