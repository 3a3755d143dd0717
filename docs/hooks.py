"""Build-time hooks of the documentation site (``hooks:`` in ``mkdocs.yml``)."""

from __future__ import annotations
