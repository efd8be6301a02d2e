"""``docs/cli.md`` is what ``scripts/gen_cli_docs.py`` makes from the argparse definitions (never stale)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_cli_reference_is_current() -> None:
    gen = _generator()
    want = gen.render()
    have = (ROOT / "docs" / "cli.md").read_text()
    assert have == want, "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_cli_reference_covers_every_subcommand_and_serve_flag(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from tetriinfer.server.cli import add_subparsers

    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    text = _generator().render()
    assert "sk-must-not-leak" not in text  # defaults from the environment are not written out
    parser = argparse.ArgumentParser()
    add_subparsers(parser.add_subparsers())
    serve = next(iter(parser._subparsers._group_actions[0].choices.values()))  # type: ignore[union-attr]
    flags = [o for a in serve._actions for o in a.option_strings if o.startswith("--")]
    section = text.split("## `tetriinfer serve`")[1].split("\n## ")[0]
    missing = [f for f in flags if f"`{f}`" not in section and f != "--help"]
    assert len(flags) > 50 and not missing, missing
    for cmd in ("bench side-by-side", "sim placement", "checkpoint convert", "make-model", "predictor train"):
        assert re.search(rf"^#+ `tetriinfer {cmd}`$", text, re.M), cmd
