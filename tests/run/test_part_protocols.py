"""Every fleet backend is a :class:`Fleet` and every policy backend a :class:`PolicyBackend`: each method of the
protocol is there, callable, with the protocol's parameters (names, kinds and defaults) in the protocol's order,
so the run calls them all plainly and never asks whether one is there."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from rollhub.rollout.backends.local import LocalFleet
from rollhub.rollout.backends.processes import ProcessFleet
from rollhub.rollout.backends.ray import FleetClient
from rollhub.rollout.protocols import Fleet
from rollhub.run.backend import PolicyBackend
from rollhub.run.group_parts import LocalBackend
from rollhub.run.llm import EngineBackend


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    """The methods a protocol declares (its own, not ``Protocol``'s machinery), with their signatures."""
    return {
        name: inspect.signature(value)
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


def shape(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
    """What a caller relies on: each parameter's name, kind and default (annotations are strings here)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def mismatches(cls: type, protocol: type) -> list[str]:
    """How ``cls`` fails ``protocol`` (empty: it satisfies it)."""
    problems = []
    for name, wanted in protocol_methods(protocol).items():
        found = inspect.getattr_static(cls, name, None)
        if found is None or not callable(found):
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        got = inspect.signature(getattr(cls, name))
        if shape(got) != shape(wanted):
            problems.append(f"{cls.__name__}.{name}{got} is not {protocol.__name__}.{name}{wanted}")
    return problems


@pytest.mark.parametrize("cls", [FleetClient, LocalFleet, ProcessFleet])
def test_every_fleet_backend_is_a_fleet(cls: type) -> None:
    assert mismatches(cls, Fleet) == []


@pytest.mark.parametrize("cls", [LocalBackend, EngineBackend])
def test_every_policy_backend_is_a_policy_backend(cls: type) -> None:
    assert mismatches(cls, PolicyBackend) == []


def test_the_protocols_name_what_the_run_calls() -> None:
    assert set(protocol_methods(Fleet)) == {"publish", "statistics", "curriculum", "status", "check", "stop"}
    assert set(protocol_methods(PolicyBackend)) == {
        "trainer_model", "manager_factory", "evaluator", "load_eval_weights", "ships_weights", "deliver", "check",
        "metrics", "summary", "engine_reads", "close",
    }  # fmt: skip


def test_the_check_finds_a_missing_method_and_a_changed_signature() -> None:
    class NoCheck(LocalBackend):
        check = None  # type: ignore[assignment]

    class OtherDeliver(LocalBackend):
        def deliver(self, arrays: dict[str, Any], version: int) -> None:  # type: ignore[override]
            """Parameters in another order."""

    assert mismatches(NoCheck, PolicyBackend) == ["NoCheck.check is missing"]
    [problem] = mismatches(OtherDeliver, PolicyBackend)
    assert problem.startswith("OtherDeliver.deliver(self, arrays")


def test_the_local_backend_is_a_policy_backend_at_run_time() -> None:
    from rollhub.run.config import load_config

    config = load_config({"env": {"kind": "group", "id": "mock"}})
    backend = LocalBackend(config.policy, config.run.seed, config.sampling.overrides())
    assert isinstance(backend, PolicyBackend) and backend.ships_weights()
    backend.check()
    assert backend.metrics(None, []) == {} and backend.summary() == {}
    backend.close()
