"""What ``/dashboard`` shows: the page itself (open, it carries no data) and the snapshot its script polls.

The page is served without an API key so that its key box can be reached in a browser; the snapshot route is
protected like every other data route, and the page's script sends the key it was given as
``Authorization: Bearer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollhub.buffer import ExperienceBuffer
from rollhub.server import shapes
from rollhub.server.metrics import NO_ENV, by_name, env_names, queued_by_env

PAGE = (Path(__file__).parent / "dashboard.html").read_text()
PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"


def snapshot(buffer: ExperienceBuffer) -> dict[str, Any]:
    """``/status``, cumulative flow counters and histograms, plus one row per environment, named as it registered.

    Each row has ``env_id``, ``name`` (the ``desired_name`` it registered with), ``wandb_name`` (unique per
    registration), ``connected``, ``weight``, ``group_size``, ``min_batch_allocation``, ``queued_sequences``,
    ``held_sequences``, ``stale_dropped`` and ``served_sequences``. Groups posted without an ``env_id`` are counted
    in one row named ``(no env)``. The counters (``served``, ``ingested``, ``refused_429``, ``stale_dropped_total``,
    ``lease_expiries``, ``serve_failures``) count since the server started; ``staleness`` and ``age_s`` give
    ``le`` (bucket upper bounds) and ``counts`` (per bucket, not cumulative, the last one for values above the
    last bound).
    """
    status = shapes.status(buffer.status())
    c = buffer.counters
    queued = {env_id: row[1] for env_id, row in queued_by_env(buffer).items()}
    stale = status["stale_dropped"]
    served = dict(c.served_by_env)
    rows = [
        {
            "env_id": env.env_id,
            "name": env.desired_name,
            "wandb_name": env.wandb_name,
            "connected": env.connected,
            "weight": env.weight,
            "group_size": env.group_size,
            "min_batch_allocation": env.min_batch_allocation,
            "queued_sequences": queued.get(env.env_id, 0),
            "held_sequences": buffer.held_sequences(env.env_id),
            "stale_dropped": stale.get(str(env.env_id), 0),
            "served_sequences": served.get(env.env_id, [0, 0])[1],
        }
        for env in list(buffer.envs)
    ]
    if queued.get(None) or None in served or stale.get("None"):
        rows.append(
            {
                "env_id": None,
                "name": NO_ENV,
                "wandb_name": None,
                "connected": None,
                "weight": None,
                "group_size": None,
                "min_batch_allocation": None,
                "queued_sequences": queued.get(None, 0),
                "held_sequences": 0,
                "stale_dropped": stale.get("None", 0),
                "served_sequences": served.get(None, [0, 0])[1],
            }
        )
    return {"status": status, "envs": rows, **_flows(buffer, stale)}


def _flows(buffer: ExperienceBuffer, stale: dict[str, int]) -> dict[str, Any]:
    c = buffer.counters
    names = env_names(buffer)
    served = dict(c.served_by_env)
    return {
        "served": {
            "groups": sum(row[0] for row in served.values()),
            "sequences": c.sequences_out,
            "by_env": by_name(names, served, 1),
        },
        "ingested": {
            "groups": c.groups_in,
            "sequences": c.sequences_in,
            "by_env": by_name(names, c.ingested_by_env, 1),
        },
        "refused_429": c.refused_full,
        "stale_dropped_total": sum(stale.values()),
        "lease_expiries": c.lease_expiries,
        "serve_failures": c.serve_failures,
        "staleness": buffer.observed.staleness.to_json(),
        "age_s": buffer.observed.age.to_json(),
    }
