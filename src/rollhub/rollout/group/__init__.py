"""Group managers: LLM group environments sampled through an inference engine into scored
:class:`~rollhub.experience.Group` items.

``manager`` (the :class:`~rollhub.rollout.group.manager.GroupRolloutManager`), ``lessons`` (the worker's lesson
plan against the run's curriculum) and ``files`` (groups to JSON-lines rollout files and back).
"""
