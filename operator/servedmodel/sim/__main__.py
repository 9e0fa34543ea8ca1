"""`python -m servedmodel.sim ...` = `servedmodel sim ...` without the dispatcher."""

from __future__ import annotations

import argparse

from servedmodel.sim.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="servedmodel sim")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
