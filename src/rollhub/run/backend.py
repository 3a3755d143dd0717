"""The policy backend of a group run: where the policy the rollouts sample lives, as the run sees it.

Two backends implement :class:`PolicyBackend`: :class:`~rollhub.run.group_parts.LocalBackend` (the built-in tiny
transformer, a copy in every process that loads each published version) and
:class:`~rollhub.run.llm.EngineBackend` (a Hugging Face model sampled through vLLM engines that every version is
pushed into). The assembler (:mod:`rollhub.run.assemble`) builds one; the publisher, the sources and the monitor
call it without asking which it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rollhub.curriculum import CurriculumConfig
from rollhub.inference.engine_idle import IdleCounts
from rollhub.rollout.group.manager import GroupRolloutManager

if TYPE_CHECKING:
    from rollhub.train.grpo import GRPOTrainer


@runtime_checkable
class PolicyBackend(Protocol):
    """The policy of a group run: the trainer's copy, the rollout side's samplers, the weight delivery and the
    figures it adds to the metrics and the summary."""

    def trainer_model(self) -> Any:
        """A fresh copy of the policy's model for the trainer (float32 master weights)."""
        ...

    def manager_factory(self, curriculum: CurriculumConfig) -> Callable[[str], GroupRolloutManager]:
        """A picklable ``worker_id -> GroupRolloutManager`` sampling this policy."""
        ...

    def evaluator(self, curriculum: CurriculumConfig) -> GroupRolloutManager:
        """The manager held-out evaluation samples with."""
        ...

    def load_eval_weights(self, evaluator: GroupRolloutManager, weights: Callable[[], dict[str, Any]]) -> None:
        """Bring ``evaluator`` to the trainer's current weights (``weights()`` reads them)."""
        ...

    def ships_weights(self) -> bool:
        """Whether each published version must travel to the rollout side as arrays (``False``: the samplers
        read a policy the backend already pushed the version into, so only the version number travels)."""
        ...

    def deliver(self, version: int, arrays: dict[str, Any]) -> None:
        """Hand the published ``version`` (tensors in ``policy.dtype``) to the backend's own samplers."""
        ...

    def check(self) -> None:
        """Raise when the backend can no longer sample (an engine died)."""
        ...

    def metrics(self, trainer: GRPOTrainer, probe: list[list[int]]) -> dict[str, float]:
        """The backend's figures for one update's metrics row."""
        ...

    def summary(self) -> dict[str, Any]:
        """The backend's fields of the run's summary."""
        ...

    def engine_reads(self) -> list[IdleCounts]:
        """Each inference engine's idle reads so far (:mod:`rollhub.inference.engine_idle`; none without engines)."""
        ...

    def close(self) -> None:
        """Release what the backend started."""
        ...
