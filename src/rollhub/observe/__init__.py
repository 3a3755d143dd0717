"""Observability shared by the run and the buffer server: the rollout fleet's figures as a report and as
Prometheus text (:mod:`rollhub.observe.fleet_report`, :mod:`rollhub.observe.fleet_metrics`), the label
escaping every Prometheus page of rollhub's uses (:mod:`rollhub.observe.prometheus`), and the ``--log-level``
option and log format of the long-running commands (:mod:`rollhub.observe.logs`). Plain Python and pydantic: no
Ray, no web framework."""
