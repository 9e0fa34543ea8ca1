"""The `servedmodel` command: run | crd | sim | probe.

Each subcommand lives with its layer (a module exposing `add_arguments` and `main`) and is
imported only when chosen, so `servedmodel sim` never imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("servedmodel.handlers.run", "run the operator (kopf) against the current kubeconfig"),
    "crd": ("servedmodel.api.crd", "print the ServedModel CRD generated from the API models"),
    "sim": ("servedmodel.sim.cli", "run the vLLM-compatible engine simulator (needs servedmodel[sim])"),
    "probe": ("servedmodel.probe.cli", "probe one OpenAI-compatible vLLM endpoint and print the waterfall"),
}
# Subcommands whose dependencies are an extra, not installed with the operator (pyproject.toml).
EXTRAS: dict[str, str] = {"sim": "sim"}
MISSING_EXTRA_EXIT = 3


class MissingExtra(Exception):
    """A subcommand's dependencies are not installed: say which extra brings them."""

    def __init__(self, command: str, module: str) -> None:
        extra = EXTRAS[command]
        super().__init__(
            f"servedmodel {command} needs {module}, which is not installed: it comes with the '{extra}' "
            f"extra: pip install 'servedmodel[{extra}]' (the simulator image has it; the operator image "
            "does not)"
        )


def _load(command: str) -> ModuleType:
    try:
        return importlib.import_module(SUBCOMMANDS[command][0])
    except ModuleNotFoundError as e:
        if command in EXTRAS and e.name and not e.name.startswith("servedmodel"):
            raise MissingExtra(command, e.name) from e
        raise


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="servedmodel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    try:
        for name, (_module, help_text) in SUBCOMMANDS.items():
            p = sub.add_parser(name, help=help_text)
            if name == chosen:
                _load(name).add_arguments(p)
        args = parser.parse_args(argv)
        module = _load(args.command)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return MISSING_EXTRA_EXIT
    return int(module.main(args))


if __name__ == "__main__":
    raise SystemExit(main())
