"""The `servedmodel` command: run | crd | sim | probe.

Each subcommand lives with its layer (a module exposing `add_arguments` and `main`) and is
imported only when chosen, so `servedmodel sim` never imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("servedmodel.handlers.run", "run the operator (kopf) against the current kubeconfig"),
    "crd": ("servedmodel.api.crd", "print the ServedModel CRD generated from the API models"),
    "sim": ("servedmodel.sim.cli", "run the vLLM-compatible engine simulator"),
    "probe": ("servedmodel.probe.cli", "probe one OpenAI-compatible vLLM endpoint and print the waterfall"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="servedmodel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args))


if __name__ == "__main__":
    raise SystemExit(main())
