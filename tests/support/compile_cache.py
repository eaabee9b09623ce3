"""Where the suite keeps its persistent XLA compilation cache, and keeping it bounded.

The suite's time is mostly XLA compiling tiny programs. Every JAX process of a run (both
pytest workers, every subprocess) shares one persistent cache, and the cache outlives the
run: it sits in the user's cache directory, not in the checkout, so a second run on the
same machine (a fresh clone included: CI checks out a clean clone each time) loads the
programs it did not change instead of compiling them. JAX's cache key covers the program,
the XLA flags, the jaxlib version and the device, so an entry is only ever reused for the
same compile; a program a commit changes gets a new entry.

JAX's own bound (``jax_compilation_cache_max_size``) takes a file lock and lists the whole
directory on every write, from every process of the run; the suite instead prunes once,
before the run starts (``prune``): entries unused longest go first.
"""

from __future__ import annotations

import os
from pathlib import Path

# The most the cache may hold after pruning: a full cold run of the suite writes about
# 100 MB, so this keeps the entries of many recent commits.
DEFAULT_LIMIT_BYTES = 2 << 30
_ENV_DIR = "SPADE_TEST_COMPILE_CACHE"


def cache_dir(checkout: Path) -> Path:
    """The persistent cache's directory: ``$SPADE_TEST_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/spade_jax/jax_tests`` (``~/.cache`` by default), else, where that is
    not writable, ``.cache/jax_tests`` in the checkout (which lasts as long as it does)."""
    if os.environ.get(_ENV_DIR):
        return Path(os.environ[_ENV_DIR])
    try:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (RuntimeError, KeyError):  # no home directory to be found
        return checkout / ".cache" / "jax_tests"
    wanted = home / "spade_jax" / "jax_tests"
    try:
        wanted.mkdir(parents=True, exist_ok=True)
        probe = wanted / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return wanted
    except OSError:
        return checkout / ".cache" / "jax_tests"


def prune(directory: Path, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> int:
    """Deletes the entries used longest ago until the directory holds at most
    ``limit_bytes``; returns how many it deleted. Run it before the run's processes start
    (they would otherwise read entries being deleted; a torn read is only a recompile)."""
    entries = []
    for path in directory.glob("*"):
        try:
            stat = path.stat()
        except OSError:  # deleted meanwhile
            continue
        if path.is_file():
            entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in sorted(entries):
        if total <= limit_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted
