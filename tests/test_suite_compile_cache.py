"""The suite's persistent compile cache (tests/support/compile_cache.py): where it lives
and how it is kept bounded between runs."""

from __future__ import annotations

import os

from compile_cache import cache_dir, prune


def test_prune_deletes_the_entries_used_longest_ago_down_to_the_limit(tmp_path):
    for i in range(6):
        path = tmp_path / f"k{i}-cache"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # k0 used longest ago
    assert prune(tmp_path, limit_bytes=1000) == 0  # under the limit: nothing goes
    assert prune(tmp_path, limit_bytes=350) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3-cache", "k4-cache", "k5-cache"]
    assert prune(tmp_path / "missing") == 0


def test_the_cache_lives_outside_the_checkout_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("SPADE_TEST_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert cache_dir(tmp_path / "checkout") == tmp_path / "home" / "spade_jax" / "jax_tests"
    monkeypatch.setenv("SPADE_TEST_COMPILE_CACHE", str(tmp_path / "mine"))
    assert cache_dir(tmp_path / "checkout") == tmp_path / "mine"
    monkeypatch.delenv("SPADE_TEST_COMPILE_CACHE")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # not a directory
    assert cache_dir(tmp_path / "checkout") == tmp_path / "checkout" / ".cache" / "jax_tests"
