"""Every command's ``--help`` is plain text (no reST markup from the docstrings it is built from), and every option
says what it does."""

from __future__ import annotations

import argparse

import pytest

from rollhub import cli
from rollhub.demos import arithmetic, buffer, cartpole, llm, tools
from rollhub.run import gateway
from rollhub.run.main import parser as run_parser

COMMANDS = [[], ["serve"], ["run-api"], ["run"], ["gateway"], ["demo"], *(["demo", name] for name in cli.DEMOS)]
PARSERS = {
    "serve": cli._serve_parser("rollhub serve"),
    "run": run_parser(),
    "gateway": gateway.parser(),
    "demo cartpole": cartpole.parser(),
    "demo buffer": buffer.parser(),
    "demo arithmetic": arithmetic.parser(),
    "demo llm": llm.parser(),
    "demo tools": tools.parser(),
}
HIDDEN = {"--max-wall-s", "--seconds"}  # deprecated names, kept working but out of --help


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = cli.main([*argv, "--help"])
    except SystemExit as done:
        code = done.code
    assert code == 0, argv
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(["rollhub", *argv]))
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(argv, capsys)
    assert text.startswith("usage: rollhub")
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:"):
        assert markup not in text, (argv, markup, text)


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help(name: str) -> None:
    for action in PARSERS[name]._actions:
        if action.help == argparse.SUPPRESS:
            assert set(action.option_strings) <= HIDDEN, (name, action.option_strings)
            continue
        assert action.help and len(action.help.strip()) > 5, (name, action.option_strings or action.dest)


def test_every_demo_is_walked() -> None:
    assert {f"demo {name}" for name in cli.DEMOS} <= set(PARSERS)
