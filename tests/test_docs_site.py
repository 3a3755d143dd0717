"""The documentation site's build-time code: the ``rollhub run`` config reference (``docs/hooks.py``) covers every
key of every section model of the run config, each with a description, and takes the place of its page's marker;
docstrings' reStructuredText roles become Markdown code (``docs/griffe_rst.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel

from rollhub.run.config import RunConfig
from tests.script_modules import load_script

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    return load_script(DOCS / "hooks.py", "rollhub_docs_hooks")


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models(arg)]


def _section_models() -> list[tuple[str, type[BaseModel]]]:
    """Every (TOML table, model) a run config is made of, nested tables included, walked from RunConfig."""
    out: list[tuple[str, type[BaseModel]]] = []

    def walk(path: str, annotation: Any) -> None:
        table = f"[[{path}]]" if get_origin(annotation) is list else f"[{path}]"
        for model in _models(annotation):
            out.append((table, model))
            for key, field in model.model_fields.items():
                if _models(field.annotation):
                    walk(f"{path}.{key}", field.annotation)

    for name, field in RunConfig.model_fields.items():
        walk(name, field.annotation)
    return out


def _sections(markdown: str) -> dict[str, dict[str, list[str]]]:
    """Each heading of the reference -> its table's rows by key: ``{heading: {key: [type, default, text]}}``."""
    out: dict[str, dict[str, list[str]]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line
            out[heading] = {}
        elif match := re.match(r"\| `(\w+)` \| (.*) \|$", line):
            out[heading][match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\| ", match.group(2))]
    return out


def test_every_key_of_every_section_model_is_in_the_reference(hooks: ModuleType) -> None:
    sections = _sections(hooks.config_reference())
    models = _section_models()
    assert len(models) >= 20  # every plug point's kinds, the plain sections and [[curriculum.lessons]]
    for table, model in models:
        kind = model.model_fields.get("kind")
        title = f"`{table}`" + (f' with `kind = "{kind.default}"`' if kind is not None else "")
        found = [rows for heading, rows in sections.items() if heading.split(" {#")[0].endswith(" " + title)]
        assert len(found) == 1, f"{model.__name__}: no single section headed {title}"
        rows = found[0]
        assert list(rows) == list(model.model_fields), f"{model.__name__}: keys differ"
        for key, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{key} has no Field(description=...)"
            type_text, default, text = rows[key]
            assert type_text and default, f"{table} {key}: type or default missing"
            assert " ".join(field.description.split())[:40] in text.replace(r"\|", "|"), f"{table} {key}"


def test_defaults_and_types_are_the_models(hooks: ModuleType) -> None:
    rows = _sections(hooks.config_reference())
    run = next(r for h, r in rows.items() if h.startswith("## `[run]`"))
    assert run["max_seconds"][:2] == ["number, > 0", "`600.0`"]
    assert run["max_updates"][1] == "unset"
    fleet = next(r for h, r in rows.items() if h.startswith("## `[fleet]`"))
    assert fleet["backend"][0] == '`"ray"` or `"local"` or `"processes"`'
    assert fleet["backend"][1] == '`"ray"`'
    grpo = next(r for h, r in rows.items() if 'kind = "grpo"' in h)
    assert grpo["kind"][1] == '`"grpo"` in a group run'
    assert grpo["correction_bounds"][0] == "[number, number]"


def test_the_page_marker_is_replaced_by_the_reference(hooks: ModuleType) -> None:
    page = SimpleNamespace(file=SimpleNamespace(src_uri=hooks.PAGE))
    source = (DOCS / hooks.PAGE).read_text()
    assert hooks.MARKER in source
    built = hooks.on_page_markdown(source, page=page, config=None, files=None)
    assert hooks.MARKER not in built and "| `metrics_port` |" in built
    other = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    assert hooks.on_page_markdown(hooks.MARKER, page=other, config=None, files=None) == hooks.MARKER
    with pytest.raises(ValueError, match="marker"):
        hooks.on_page_markdown("no marker here", page=page, config=None, files=None)


def test_docstring_roles_become_code(hooks: ModuleType) -> None:
    text = "A :class:`Group` of :class:`~rollhub.experience.Group`, see :mod:`rollhub.run` and ``x``."
    assert hooks.rst_to_markdown(text) == "A `Group` of `Group`, see `rollhub.run` and ``x``."
    assert hooks.rst_to_markdown(":py:func:`rollhub.models.build_tiny_model`") == "`rollhub.models.build_tiny_model`"
