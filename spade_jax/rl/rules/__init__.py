"""Built-in update rules, one per file. Importing this package imports every module in it,
and each module registers its rules with :mod:`spade_jax.rl.registry` at import time, so a
new rule is a new file here and nothing else."""

import importlib
import pkgutil

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")
