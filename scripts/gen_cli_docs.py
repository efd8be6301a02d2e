"""Write ``docs/cli.md``: every ``tetriinfer`` subcommand's flags, from the argparse definitions themselves.

    python scripts/gen_cli_docs.py            # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check    # exit 1 if docs/cli.md differs from what the code defines

The output depends only on the parser definitions: no terminal width, no environment (a default read from the
environment, such as an API key, is shown as ``(from the environment)``), so the same code always gives the same
file. ``tests/test_cli_docs.py`` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"
HEADER = """# Command-line reference

Generated from the argparse definitions by `python scripts/gen_cli_docs.py` (do not edit by hand; a test fails
when this file is stale). `tetriinfer COMMAND --help` prints the same options.
"""
# Defaults that come from the environment of whoever runs the generator.
ENV_DEFAULTS = {"api_key"}


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of each direct subcommand, in definition order."""
    out: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                out.append((name, sub, helps.get(name, "")))
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    if action.nargs == 0:
        return names
    if action.metavar is not None:
        meta = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        meta = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        meta = action.dest.upper()
    return f"{names} {_cell(meta)}"


def _default(action: argparse.Action) -> str:
    if action.dest in ENV_DEFAULTS:
        return "(from the environment)"
    if action.required or not action.option_strings:
        return "required"
    if action.nargs == 0 and isinstance(action.default, bool):
        return "on" if action.default else "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{_cell(action.default)}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(default)" in text:
        text = text.replace("%(default)s", str(action.default))
    return _cell(text)


def _section(path: list[str], parser: argparse.ArgumentParser, summary: str, out: list[str]) -> None:
    subs = _subparsers(parser)
    level = "#" * min(len(path), 4)
    out.append(f"{level} `{' '.join(path)}`\n")
    text = _cell(parser.description or summary)
    if text:
        out.append(text + "\n")
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        title = group.title or "options"
        out.append(f"**{title}**" + (f": {_cell(group.description)}" if group.description else "") + "\n")
        out.append("| option | default | meaning |\n|---|---|---|")
        for a in actions:
            out.append(f"| {_flag(a)} | {_default(a)} | {_help(a)} |")
        out.append("")
    if subs:
        out.append("Subcommands: " + ", ".join(f"`{name}`" for name, _, _ in subs) + ".\n")
    for name, sub, help_text in subs:
        _section([*path, name], sub, help_text, out)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from tetriinfer.cli import build_parser

    parser = build_parser()
    out = [HEADER]
    top = _subparsers(parser)
    out.append("| command | what it does |\n|---|---|")
    for name, _, help_text in top:
        out.append(f"| `tetriinfer {name}` | {_cell(help_text)} |")
    out.append("")
    for name, sub, help_text in top:
        _section(["tetriinfer", name], sub, help_text, out)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale instead of writing it")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    os.environ.pop("OPENAI_API_KEY", None)
    text = render()
    path = Path(args.out)
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
