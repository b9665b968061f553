"""``python -m lightning_gravac quickstart | run RECIPE | recipes | fit --config my.yaml``."""

import sys

from lightning_gravac.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
