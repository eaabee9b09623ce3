"""A CPU world where SPADE's mechanism is visible (``docs/toy_world.md``).

``family``: the key-digit games, whose difficulty is the level the designer writes.
``chain`` / ``chain_world``: the chain games (count up from a start), the alternative
family selected by ``ToyConfig.family="chain"`` (``experiments/chain.py``).
``world``: the warm start, tokenizer text, fixed curriculum and held-out grid of a run
(``ExperimentConfig.toy``). ``check``: the learning check's verdict on a run's metrics.
"""

# Only the family here: it imports nothing of the package, so the loop's metrics can read
# a program's level without importing the world (which imports the loop's prompts).
from spade_jax.toy.family import LEVELS, RULES, hint_for, program_level, render_program

__all__ = ["LEVELS", "RULES", "hint_for", "program_level", "render_program"]
