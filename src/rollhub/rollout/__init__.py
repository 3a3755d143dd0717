"""Rollout: step and group managers, the RolloutWorker actor, the RolloutFleet, fragments, statistics."""
