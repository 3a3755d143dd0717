"""``make test`` runs two workers with ``--dist loadgroup``: the groups ``tests/conftest.py`` gives each test (its
file; every test that starts a real vLLM engine, one group) must reach xdist's scheduler. Where they do not, nothing
fails on its own: the tests of a file are dealt to both workers, its module fixtures are made twice, and two vLLM
engines start at once on a two-core machine."""

from __future__ import annotations

import os

import pytest


def test_this_test_is_scheduled_in_its_files_group(request: pytest.FixtureRequest) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("checks the grouping of pytest -n N --dist loadgroup (make test)")
    # xdist carries the group to its scheduler as a suffix of the node id; a pytest whose node ids ignore that
    # (9.2, pytest-xdist issue 1386) loses every group
    assert request.node.nodeid.endswith("@tests/test_suite_grouping.py"), (
        f"{request.node.nodeid}: xdist's loadgroup lost this test's group; use a pytest that keeps it (see the "
        "pytest pin in pyproject.toml)"
    )
