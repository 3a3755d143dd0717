"""Where a RolloutWorker's sender puts its items, besides a fleet's own buffer: ``http_writer`` (the buffer
server over HTTP) and ``file_writer`` (JSON-lines rollout files). The Ray fleet's writer to its replay-buffer
actor lives with the Ray backend (:class:`rollhub.rollout.backends.ray.ActorWriter`).
"""
