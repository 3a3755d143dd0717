"""One convention across the demos and ``rollhub run``: ``--max-seconds`` (old names still work), run directories
under ``rollhub-runs/``, ``--no-progress``, ``--print-config`` showing only what applies, ``--write-config``."""

from __future__ import annotations

import argparse
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from rollhub.demos import arithmetic, buffer, cartpole, llm
from rollhub.run.config import load_config, read_toml
from rollhub.run.main import main as run_main
from rollhub.run.main import shipped_config, shipped_text

SHIPPED = sorted(p.name.removesuffix(".toml") for p in resources.files("rollhub.run.configs").iterdir()
                 if p.name.endswith(".toml"))  # fmt: skip
CONFIG_DEMOS = {"cartpole": cartpole, "arithmetic": arithmetic, "llm": llm}


def test_every_shipped_config_runs_under_rollhub_runs() -> None:
    assert set(SHIPPED) == set(CONFIG_DEMOS)
    for name in SHIPPED:
        assert shipped_config(name)["run"]["dir"] == f"rollhub-runs/{name}"


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {flag for action in p._actions for flag in action.option_strings}


@pytest.mark.parametrize("module", [cartpole, arithmetic, llm, buffer], ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_demo_takes_max_seconds(module: object) -> None:
    p = module.parser()  # type: ignore[attr-defined]
    assert "--max-seconds" in _options(p) and p.parse_args(["--max-seconds", "7"]).max_seconds == 7.0


@pytest.mark.parametrize(
    ("module", "old", "default"), [(arithmetic, "--max-wall-s", None), (buffer, "--seconds", 10.0)]
)
def test_the_old_time_limit_names_still_work_hidden_with_a_note(
    module: object, old: str, default: float | None, capsys: pytest.CaptureFixture[str]
) -> None:
    p = module.parser()  # type: ignore[attr-defined]
    assert p.parse_args([old, "5"]).max_seconds == 5.0
    assert f"{old} is deprecated; use --max-seconds" in capsys.readouterr().err
    assert old not in p.format_help()
    assert p.parse_args([]).max_seconds == default  # the alias leaves the default alone


def test_max_seconds_sets_the_arithmetic_runs_time_limit() -> None:
    assert arithmetic.demo_config(arithmetic.parser().parse_args(["--max-seconds", "42"])).run.max_seconds == 42.0


@pytest.mark.parametrize("name", list(CONFIG_DEMOS))
def test_write_config_copies_the_shipped_config_to_edit_and_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = CONFIG_DEMOS[name].main
    target = tmp_path / "mine" / "my.toml"
    assert main(["--write-config", str(target)]) == 0
    assert target.read_text() == shipped_text(name)  # comments and all
    assert f"rollhub run {target}" in capsys.readouterr().err
    assert load_config(read_toml(target)) == load_config(shipped_config(name))
    assert main(["--write-config", str(target)]) == 2 and "exists" in capsys.readouterr().err
    assert main(["--write-config", "-"]) == 0 and capsys.readouterr().out == shipped_text(name)
    assert main(["--write-config", "-", "--seed", "3"]) == 2 and "--seed" in capsys.readouterr().err


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert run_main(["--print-config", *argv]) == 0
    return tomllib.loads(capsys.readouterr().out)


def _shipped_path(name: str) -> str:
    return str(resources.files("rollhub.run.configs").joinpath(f"{name}.toml"))


def test_print_config_shows_only_the_sections_of_the_runs_kind(capsys: pytest.CaptureFixture[str]) -> None:
    step = _printed(capsys, _shipped_path("cartpole"))
    assert {"run", "env", "policy", "fleet", "writer", "trainer", "weights"} <= set(step)
    assert not {"inference", "eval", "curriculum", "sampling"} & set(step)
    group = _printed(capsys, _shipped_path("arithmetic"))
    assert {"eval", "curriculum", "sampling"} <= set(group) and "inference" not in group
    assert "inference" in _printed(capsys, _shipped_path("llm"))
    assert load_config(step) == load_config(shipped_config("cartpole"))  # what is left out is the defaults


def test_rollhub_run_no_progress_switches_the_progress_line_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert _printed(capsys, _shipped_path("cartpole"))["run"]["progress"] is True
    assert _printed(capsys, _shipped_path("cartpole"), "--no-progress")["run"]["progress"] is False
