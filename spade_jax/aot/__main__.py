"""``python -m spade_jax.aot``; see :mod:`spade_jax.aot.cli`."""

from spade_jax.aot.cli import run

if __name__ == "__main__":
    run()
