"""rollhub's docstrings in Markdown: the reStructuredText roles they use, made plain code.

The docstrings are Google style with a little reStructuredText inside: ``code`` in double backticks (already
inline code in Markdown) and roles such as :class:`Group`, :func:`~rollhub.x.f` or :mod:`rollhub.run`. A role
becomes the code span of its target (``~`` keeps the last name only), so the pages read as the source does and no
link can point at a page the site does not build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const|ref):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def rst_to_markdown(text: str) -> str:
    """``text`` with every reStructuredText role replaced by the code span of its target."""
    return ROLE.sub(_role, text)


class RstRoles(griffe.Extension):
    """A Griffe extension (``extensions:`` of the mkdocstrings handler): every docstring through
    :func:`rst_to_markdown` before it is parsed and rendered."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
