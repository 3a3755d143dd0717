"""Build-time hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

The ``rollhub run`` config reference is generated here from the pydantic models of
:mod:`rollhub.run.config` at every build: every section, key, type, default and description, so no page repeats
them by hand. ``config-reference.md`` holds the prose around it and the marker the tables replace.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "src"))  # document this checkout's code, installed or not

from rollhub.run.config import RunConfig  # noqa: E402
from rollhub.run.config_group import GROUP_DEFAULTS  # noqa: E402

MARKER = "<!-- generated: rollhub run config reference -->"
PAGE = "config-reference.md"


def _load_rst() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("rollhub_docs_griffe_rst", DOCS / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rst_to_markdown = _load_rst().rst_to_markdown


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names, in order (through unions, ``Annotated`` and containers)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in models_in(arg)]


def _is_array(annotation: Any) -> bool:
    return get_origin(annotation) is list


def type_text(annotation: Any) -> str:
    """A TOML reader's name for a field's type (an optional field is its type: leave it out to unset it)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin in (Union, types.UnionType):
        kept = [arg for arg in args if arg is not type(None)]
        return " or ".join(dict.fromkeys(type_text(arg) for arg in kept))
    if origin is Literal:
        return " or ".join(f'`"{value}"`' for value in args)
    if origin is list:
        inner = type_text(args[0])
        return "array of " + ("tables" if inner == "table" else f"{inner}s")
    if origin is tuple:
        return "[" + ", ".join(type_text(arg) for arg in args) + "]"
    if origin is dict:
        return "table" if args[1] is Any else f"table of {type_text(args[1])}s"
    names = {str: "string", Path: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return "any"


_BOUNDS = {
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.Lt: ("<", "lt"),
}


def bounds_text(field: FieldInfo) -> str:
    """The field's numeric bounds, e.g. ``>= 1, <= 65535`` (empty when it has none)."""
    out = []
    for item in field.metadata:
        for kind, (sign, attr) in _BOUNDS.items():
            if isinstance(item, kind):
                out.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, annotated_types.MinLen) and item.min_length:
            out.append(f"at least {item.min_length} long")
    return ", ".join(out)


def toml_text(value: Any) -> str:
    """A default as it would be written in the config file (``unset`` for ``None``: the key is left out)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str | Path):
        return f'`"{value}"`'
    if isinstance(value, int | float):
        return f"`{value!r}`"
    if isinstance(value, list | tuple | dict):
        return f"`{json.dumps(value, default=str)}`"
    return f"`{value!r}`"


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, list) and not value and models_in(field.annotation):
        return "none"
    return toml_text(value)


def _cell(text: str) -> str:
    """``text`` fit for a table cell: one line, pipes outside code spans escaped."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") else part.replace("|", r"\|") for part in parts)


def _summary(model: type[BaseModel]) -> str:
    """The model's docstring without the ``[section] with kind = "x":`` lead its heading already says."""
    doc = " ".join((inspect.getdoc(model) or "").split())
    doc = re.sub(r'^``\[\[?[\w.]+\]\]?``( with ``kind = "\w+"``)?: ', "", doc)
    return rst_to_markdown(doc[:1].upper() + doc[1:])


def _heading(table: str, model: type[BaseModel], level: int) -> str:
    kind = model.model_fields.get("kind")
    name = table.strip("[]")
    anchor = name.replace(".", "-") + (f"-{kind.default}" if kind is not None else "")
    title = f"`{table}`" + (f' with `kind = "{kind.default}"`' if kind is not None else "")
    return f"{'#' * level} {title} {{#{anchor}}}"


def model_section(table: str, model: type[BaseModel], level: int = 3, kind_default: str = "required") -> str:
    """One model's heading, summary and table of keys, then the sections of the tables nested in it.

    ``kind_default`` is what the ``kind`` row says as its default: whether a table that names no kind is this one.
    """
    lines = [_heading(table, model, level), "", _summary(model), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for key, field in model.model_fields.items():
        kind = type_text(field.annotation)
        bounds = bounds_text(field)
        if bounds:
            kind += f", {bounds}"
        description = field.description or ""
        inner = models_in(field.annotation)
        if inner:
            sub = f"[[{table.strip('[]')}.{key}]]" if _is_array(field.annotation) else f"[{table.strip('[]')}.{key}]"
            nested += [model_section(sub, m, level) for m in inner]
            description += f" See `{sub}` below."
        default = kind_default if key == "kind" else default_text(field)
        lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(description)} |")
    return "\n".join([*lines, "", *nested])


def _kind_default(section: str, model: type[BaseModel], first: bool) -> str:
    """The ``kind`` row's default: the kind a table that names none takes (for a step run, a group run, or both)."""
    kind = model.model_fields["kind"].default
    if section in GROUP_DEFAULTS and (first or GROUP_DEFAULTS[section] == kind):
        return f'`"{kind}"` in a {"step" if first else "group"} run'
    return f'`"{kind}"`' if first else "required"


def config_reference() -> str:
    """The reference of every section of :class:`rollhub.run.config.RunConfig`, as Markdown."""
    lines = ["| section | what it is | kinds |", "|---|---|---|"]
    sections = []
    for name, field in RunConfig.model_fields.items():
        table = f"[[{name}]]" if _is_array(field.annotation) else f"[{name}]"
        models = models_in(field.annotation)
        kinds = [m.model_fields["kind"].default for m in models if "kind" in m.model_fields]
        kind_text = ", ".join(f"`{k}`" for k in kinds)
        if name in GROUP_DEFAULTS:
            kind_text += f" (default `{kinds[0]}`; in a group run `{GROUP_DEFAULTS[name]}`)"
        elif len(kinds) > 1:
            kind_text += f" (default `{kinds[0]}`)"
        lines.append(f"| [`{table}`](#{name}) | {_cell(field.description or '')} | {kind_text} |")
        if len(models) == 1 and "kind" not in models[0].model_fields:
            sections.append(model_section(table, models[0], level=2))
            continue
        body = "\n".join(
            model_section(table, model, kind_default=_kind_default(name, model, first=model is models[0]))
            for model in models
        )
        sections.append(f"## `{table}` {{#{name}}}\n\n{_cell(field.description or '')}\n\n{body}")
    return "\n".join(lines) + "\n\n" + "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the generated reference where ``config-reference.md`` has its marker."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER!r}; put it back where the reference goes")
    return markdown.replace(MARKER, config_reference())
