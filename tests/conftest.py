"""Test-wide setup: 8 simulated CPU devices for the sharded tests, and the session fixtures
that several test files share (built once per pytest run, so their compiles are paid once).

The device flag must be set before JAX initialises its backend, hence at import and not in
a fixture.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Compile-speed flags for XLA:CPU: LLVM at -O0, the classic fusion emitters, one codegen
# split (tests/support/xla_test_flags.py says why and which subprocesses keep the default
# flags). Set an optimization level yourself to run the suite without them.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    from xla_test_flags import fast_compile

    os.environ["XLA_FLAGS"] += f" {fast_compile()}"

# One persistent compilation cache for every JAX process of the run (both workers and
# every subprocess: they inherit the environment), kept between runs in the user's cache
# directory (tests/support/compile_cache.py): a program compiled once (the tiny
# experiment's train step, its samplers) is loaded from disk by every later test file
# (after ``jax.clear_caches()`` below), every `python -m spade_jax.train` subprocess and
# every later run of the suite on this machine, instead of being compiled again. Every
# program is stored (a tiny program's compile, ~0.1-0.3 s, is paid again by every file
# after the per-file cache clearing below; reading it back takes milliseconds). Tests
# that need a cache of their own (a resumed run reloading the killed run's programs) set
# their own directory.
# Only the directory the suite chose is pruned (below): a cache the user named is theirs.
_PRUNED_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    from compile_cache import cache_dir

    _PRUNED_CACHE = cache_dir(Path(__file__).resolve().parents[1])
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_PRUNED_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The test files that take longest (minutes each, measured from the CI log's durations),
# longest first. pytest-xdist hands whole files to its two workers in collection order
# (pyproject sets --no-loadscope-reorder, which would otherwise order files by test
# count and leave these few-test, long files for the end, where one worker runs the last
# of them while the other idles). Order only: no test depends on it.
LONG_FILES_FIRST = (
    "tests/cli/test_train_cli.py",
    "tests/toy/test_designer_check.py",
    "tests/multihost/test_multihost_model.py",
    "tests/spade/test_router_replay.py",
    "tests/cli/test_tool_use_cli.py",
    "tests/test_exact_replay.py",
    "tests/toy/test_learning_check.py",
    "tests/rollout/test_engine.py",
    "tests/test_gcs_paths.py",
    "tests/multihost/test_multihost_train.py",
    "tests/rl/test_update_rule_end_to_end.py",
    "tests/test_sharded_experiment.py",
)


def pytest_configure(config):
    """Bounds the persistent compile cache once per run, in the controlling process
    before any worker starts (tests/support/compile_cache.py)."""
    if hasattr(config, "workerinput") or _PRUNED_CACHE is None:  # a worker, or the user's
        return
    from compile_cache import prune

    prune(_PRUNED_CACHE)


def pytest_collection_modifyitems(config, items):
    """Long files first (in LONG_FILES_FIRST's order), then the others, files with more
    tests first (xdist's own default order), each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::", 1)[0]] = counts.get(item.nodeid.split("::", 1)[0], 0) + 1

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return (rank.get(path, len(rank)), -counts[path], path)

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test file. Every XLA:CPU executable maps
    about ten memory regions; the whole suite in one process compiles enough of them to
    pass the kernel's 65530-map limit (vm.max_map_count), and LLVM then aborts the process
    mid-compile (seen in CI at ~88% of the suite). Files that share a session fixture
    recompile what they call; that costs seconds."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A 300-piece sentencepiece tokenizer with the chat-template tokens (agent-loop tests)."""
    from spade_jax.tokenizers import train_sentencepiece

    text = ["alpha start seed obs beta gamma 0 1 2 3 4 5 6 7 8 9 " * 4, "user assistant\n"]
    return train_sentencepiece(text, tmp_path_factory.mktemp("spm") / "tok", vocab_size=300)


@pytest.fixture(scope="session")
def chat_model(chat_tokenizer):
    """A random 2-layer dense Qwen3 over ``chat_tokenizer``'s vocabulary, filled from NumPy
    (eager nnx init compiles op by op: slow). Shared by the rollout and envs tests."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from spade_jax.models import ModelConfig, abstract_model

    cfg = ModelConfig(vocab_size=chat_tokenizer.vocab_size, hidden_size=32, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
    graphdef, shapes = nnx.split(abstract_model(cfg))
    rs = np.random.RandomState(0)

    def fill(x):  # norms (1-D) near 1, matrices small
        noise = rs.normal(0, 0.1, x.shape)
        return jnp.asarray((1 + noise if len(x.shape) == 1 else noise).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree.map(fill, shapes))


@pytest.fixture(scope="module")
def gcs():
    """A local GCS emulator (tests/support/gcs_emulator.py) that gs:// paths in the test reach."""
    from gcs_emulator import GcsEmulator, apply_env, restore_env

    emulator = GcsEmulator()
    previous = apply_env(emulator)
    try:
        yield emulator
    finally:
        emulator.stop()
        restore_env(previous)
