"""``python -m lightning_gradguard.report RUN_DIR [-o PATH]``: the same as ``gradguard report``."""

import sys

from lightning_gradguard.report.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["report", *sys.argv[1:]]))
