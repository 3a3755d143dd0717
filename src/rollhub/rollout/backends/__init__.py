"""The fleets that create, feed and supervise RolloutWorkers, all with the same surface for the trainer.

``base`` (what they share: :class:`~rollhub.rollout.backends.base.FleetConfig`, ``FleetError``), ``local``
(worker threads in the trainer's process), ``processes`` (one process per worker on this machine) and ``ray``
(worker actors over a Ray cluster, and the replay buffer as an actor). Only ``ray`` imports Ray.
"""
