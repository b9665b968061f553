"""Run a recipe from a checkout: ``python recipes/run.py [name or path.yaml] [dotted.key=value ...]``.

The recipes themselves ship inside the package (``lightning_gravac/recipes/``; ``python -m lightning_gravac recipes``
lists them, ``python -m lightning_gravac run NAME`` runs one from an installed wheel). With no argument it runs the
quickstart: a small model on synthetic data, 2 CPU processes, no download.
Overrides use omegaconf's dotted syntax, e.g. ``trainer.max_steps=50 model.init_args.lr=0.05``.
"""

import sys

from lightning_gravac.cli import in_one_line, run_recipe

if __name__ == "__main__":
    in_one_line(run_recipe, sys.argv[1:])
