"""The one `tetriinfer` command.

Each subsystem owns the argparse wiring of its own subcommands in a module with an
``add_subparsers(subparsers)`` function; this file only collects them, so that
importing the CLI stays cheap (heavy imports happen inside the handlers).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, attribute) pairs; each attribute is ``add_subparsers(subparsers) -> None``.
_SUBCOMMAND_MODULES: tuple[str, ...] = (
    "tetriinfer.engine.cli",
    "tetriinfer.server.cli",
    "tetriinfer.bench.cli",
    "tetriinfer.predictor.cli",
    "tetriinfer.sim.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tetriinfer",
        description="TetriInfer: disaggregated, length-aware LLM serving.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subsystem not built yet
                continue
            raise
        module.add_subparsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        result = handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tetriinfer: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
