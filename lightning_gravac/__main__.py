"""``python -m lightning_gravac fit --config recipes/<name>.yaml``."""

from lightning_gravac.cli import cli_main

if __name__ == "__main__":
    cli_main()
