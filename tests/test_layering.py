"""The package layering holds: every import in ``src/rollhub`` points down the floors, and no files import in a circle.

Each ``.py`` file under ``src/rollhub`` is parsed (not imported) and every import in it is read: the module-level
ones and the lazy ones inside functions, absolute and relative alike. A package may import only itself and the
packages on lower floors (:data:`FLOORS`); some packages have narrower rules of their own (``experience`` takes
nothing from ``wire``, ``train`` nothing from ``envs`` or ``rollout``, the buffer no HTTP library and no wire
models, and only ``cli``, ``__main__`` and the demos themselves import the demos). Between files, the arrows must
not close a circle. A failure names the file, the line, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "rollhub"

FLOORS: dict[str, int] = {
    "errors": 0,
    "experience": 1,
    "models": 1,
    "wire": 2,
    "inference": 2,
    "curriculum": 2,
    "buffer": 3,
    "envs": 3,
    "weights": 3,
    "observe": 3,
    "client": 3,
    "server": 4,
    "rollout": 4,
    "gateway": 4,
    "train": 4,
    "run": 5,
    "demos": 6,
    "cli": 6,
    "__main__": 7,
}
"""The floor of each top-level part of ``rollhub``, bottom (0) to top: a part imports only its own floor's self
and lower floors."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "experience": ("rollhub.wire",),
    "train": ("rollhub.envs", "rollhub.rollout"),
}
"""Imports a package may not make although their floor is lower: experience is pure data (its wire forms live
in wire), and the trainers learn from experience without knowing the environments or the fleet."""

BUFFER_FORBIDDEN = ("rollhub.wire", "fastapi", "starlette", "httpx")
"""What the buffer may not import: it is storage and policy; its HTTP face and the wire codec it stores with are
given to it by the server."""

RAY_IN_ROLLOUT = "rollhub.rollout.backends.ray"
"""The one module of the fleet that imports Ray: the local and process fleets run where Ray is not installed."""

DEMO_IMPORTERS = ("cli", "__main__", "demos")
"""The only parts that may import ``rollhub.demos``."""


@dataclass(frozen=True)
class Import:
    """One import of a ``rollhub`` file: the file's module, the imported module, and where it is written."""

    source: str
    path: Path
    line: int
    target: str
    text: str

    def where(self) -> str:
        """``path:line: import text`` for a failure message."""
        try:
            shown = self.path.relative_to(SRC.parent)
        except ValueError:  # a tree of the check's own test, elsewhere
            shown = self.path
        return f"{shown}:{self.line}: {self.text!r}"


def module_name(path: Path, src: Path) -> str:
    """The dotted module name of ``path`` under ``src`` (a package's ``__init__`` names the package)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module that a ``from`` import names, relative ones resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path, src: Path) -> Iterator[Import]:
    """Every import in ``path`` (module level and inside functions), as absolute module names.

    ``from package import name`` yields ``package.name`` when ``name`` is a module file under ``src``, so that
    an import of a sibling module by name counts as an arrow to that file.
    """
    module = module_name(path, src)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                name = sub if _module_path(sub, src) is not None else target
                yield Import(module, path, node.lineno, name, ast.unparse(node))


def _module_path(name: str, src: Path) -> Path | None:
    """The file that defines module ``name`` under ``src``, or None when it is no module there."""
    base = src.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def all_imports(src: Path = SRC, root: str = ROOT) -> list[Import]:
    """The imports of every ``.py`` file of package ``root`` under ``src``."""
    return [imp for path in sorted((src / root).rglob("*.py")) for imp in imports_of(path, src)]


def part(module: str, root: str = ROOT) -> str | None:
    """The top-level part of ``root`` that ``module`` belongs to (``rollhub.run.step`` -> ``run``), or None for
    a module outside ``root`` or ``root`` itself."""
    pieces = module.split(".")
    if pieces[0] != root or len(pieces) < 2:
        return None
    return pieces[1]


def _within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def floor_breaks(imports: list[Import], floors: dict[str, int], root: str = ROOT) -> list[str]:
    """Messages for the imports that go to a part on the same or a higher floor, or to a part with no floor."""
    broken = []
    for imp in imports:
        source, target = part(imp.source, root), part(imp.target, root)
        if target is None or source is None or source == target:
            continue
        if source not in floors:
            broken.append(f"{imp.where()}: '{source}' has no floor in the layering; give it one")
        elif target not in floors:
            broken.append(f"{imp.where()}: imports '{target}', which has no floor in the layering")
        elif floors[target] >= floors[source]:
            broken.append(
                f"{imp.where()}: '{source}' (floor {floors[source]}) may import only lower floors, "
                f"but '{target}' is on floor {floors[target]}"
            )
    return broken


def forbidden_breaks(imports: list[Import], package: str, prefixes: tuple[str, ...], why: str) -> list[str]:
    """Messages for the imports from ``package`` that name a module under one of ``prefixes``."""
    return [
        f"{imp.where()}: {why} (imports {imp.target})"
        for imp in imports
        if part(imp.source) == package and any(_within(imp.target, p) for p in prefixes)
    ]


def file_graph(imports: list[Import], src: Path = SRC) -> dict[str, dict[str, Import]]:
    """The arrows between files: for each module, the modules under ``src`` it imports, each with one import."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        graph.setdefault(imp.source, {})
        target = imp.target
        while target and _module_path(target, src) is None:
            target = target.rpartition(".")[0]
        if target and target != imp.source:
            graph[imp.source].setdefault(target, imp)
    return graph


def circles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def circle_messages(graph: dict[str, dict[str, Import]], circle: list[str]) -> str:
    """One message for ``circle``: its files and the imports that join them."""
    members = set(circle)
    arrows = [imp.where() for m in circle for t, imp in sorted(graph[m].items()) if t in members]
    return f"files import each other in a circle: {' <-> '.join(circle)}\n    " + "\n    ".join(arrows)


def circles_by_package(graph: dict[str, dict[str, Import]]) -> dict[str | None, list[str]]:
    """The circle messages, by the top-level part their first file belongs to."""
    found: dict[str | None, list[str]] = {}
    for circle in circles(graph):
        found.setdefault(part(circle[0]), []).append(circle_messages(graph, circle))
    return found


def _fail(broken: list[str], rule: str) -> None:
    broken = list(dict.fromkeys(broken))  # one line per import, however many names it takes
    assert not broken, f"{rule}:\n" + "\n".join(broken)


IMPORTS = all_imports()


def test_every_import_points_down_the_floors() -> None:
    _fail(floor_breaks(IMPORTS, FLOORS), "a package imports only itself and lower floors")


def test_experience_imports_nothing_of_wire() -> None:
    why = "experience holds pure data; its wire forms belong in rollhub.wire"
    _fail(forbidden_breaks(IMPORTS, "experience", FORBIDDEN["experience"], why), "experience imports no wire")


def test_train_imports_no_envs_and_no_rollout() -> None:
    why = "trainers learn from experience; what joins them to environments and the fleet belongs in rollhub.run"
    _fail(forbidden_breaks(IMPORTS, "train", FORBIDDEN["train"], why), "train imports no envs and no rollout")


def test_only_the_cli_imports_the_demos() -> None:
    broken = [
        f"{imp.where()}: only {', '.join(DEMO_IMPORTERS)} may import the demos; move what is shared below them"
        for imp in IMPORTS
        if _within(imp.target, "rollhub.demos") and part(imp.source) not in DEMO_IMPORTERS
    ]
    _fail(broken, "the demos are imported by nothing but the command line")


def test_only_the_ray_backend_of_the_fleet_imports_ray() -> None:
    broken = [
        f"{imp.where()}: in rollhub.rollout only {RAY_IN_ROLLOUT} imports ray; inject what differs under Ray"
        for imp in IMPORTS
        if part(imp.source) == "rollout" and _within(imp.target, "ray") and imp.source != RAY_IN_ROLLOUT
    ]
    _fail(broken, "only the Ray backend imports ray")


def test_buffer_imports_no_http_and_no_wire_models() -> None:
    why = "the buffer is storage and policy; HTTP and the wire codec belong in the server, which hands it the codec"
    _fail(forbidden_breaks(IMPORTS, "buffer", BUFFER_FORBIDDEN, why), "the buffer imports no HTTP library")


def test_no_file_circles_outside_the_buffer() -> None:
    found = circles_by_package(file_graph(IMPORTS))
    _fail([m for package, messages in found.items() if package != "buffer" for m in messages], "no import circles")


def test_buffer_has_no_file_circles() -> None:
    _fail(circles_by_package(file_graph(IMPORTS)).get("buffer", []), "no import circles in the buffer")


def test_every_part_has_a_floor() -> None:
    parts = {p.stem if p.is_file() else p.name for p in (SRC / ROOT).iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"__init__", "__pycache__"}
    assert parts <= set(FLOORS), f"parts of rollhub with no floor in FLOORS: {sorted(parts - set(FLOORS))}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "from . import b\n",
            "pkg/low/b.py": "def f():\n    from pkg.low.a import x\n",
            "pkg/low/c.py": "import os\n\ndef g():\n    from ..high import h\n",
            "pkg/high/__init__.py": "",
            "pkg/high/h.py": "from pkg.low import c\n",
        },
    )
    imports = all_imports(tmp_path, "pkg")
    upward = [
        imp
        for imp in imports
        if part(imp.source, "pkg") == "low" and part(imp.target, "pkg") == "high"  # the lazy, relative one
    ]
    assert [(i.path.name, i.line, i.target) for i in upward] == [("c.py", 4, "pkg.high.h")]
    broken = floor_breaks(imports, {"low": 0, "high": 1}, "pkg")
    assert len(broken) == 1 and "c.py:4" in broken[0] and "'low' (floor 0)" in broken[0], broken
    graph = file_graph(imports, tmp_path)
    found = circles(graph)
    assert ["pkg.high.h", "pkg.low.c"] in found and ["pkg.low.a", "pkg.low.b"] in found, found
    message = circle_messages(graph, ["pkg.low.a", "pkg.low.b"])
    assert "a.py:1" in message and "b.py:2" in message, message
