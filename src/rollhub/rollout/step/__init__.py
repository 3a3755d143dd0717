"""Step managers: vectors of step environments (in worker processes or inline, stepped by threads), a policy
batched over them, and the finished steps cut into :class:`~rollhub.experience.SampleFragment` items.

``manager`` (the :class:`~rollhub.rollout.step.manager.StepRolloutManager` and its factory), ``config`` (its
settings), ``threads`` (the stepping threads), ``env_worker`` and ``env_child`` (the environment processes and
their pipes), ``fragments`` (cutting steps into fragments) and ``fragment_store`` (fragments in a durable store,
for the replay buffer).
"""
