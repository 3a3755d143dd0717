"""Rollout: the fleet that turns environments and a policy into experience for the trainer.

Its parts: ``step/`` (step managers: step environments, in processes or inline, cut into fragments), ``group/``
(group managers: LLM group environments, lessons and rollout files), ``worker.py`` (the RolloutWorker that runs a
manager, with its statistics in ``stats.py`` and the writers of ``writers/``), ``backends/`` (the fleets that run
and supervise workers: ``local`` threads, ``processes``, ``ray`` actors; only ``ray`` imports Ray),
``protocols.py`` (what the parts agree on) and ``replay.py`` (the step path's replay buffer).
"""
