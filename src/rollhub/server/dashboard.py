"""What ``/dashboard`` shows: the page itself (open, it carries no data) and the snapshot its script polls.

The page is served without an API key so that its key box can be reached in a browser; the snapshot route is
protected like every other data route, and the page's script sends the key it was given as
``Authorization: Bearer``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from rollhub.buffer import ExperienceBuffer

PAGE = (Path(__file__).parent / "dashboard.html").read_text()
PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"


def snapshot(buffer: ExperienceBuffer) -> dict[str, Any]:
    """``/status`` plus one row per environment, named as it registered.

    Each row has ``env_id``, ``name`` (the ``desired_name`` it registered with), ``wandb_name`` (unique per
    registration), ``connected``, ``weight``, ``group_size``, ``queued_sequences``, ``held_sequences`` and
    ``stale_dropped``. Groups posted without an ``env_id`` are counted in one row named ``(no env)``.
    """
    status = buffer.status()
    queued: dict[int | None, int] = defaultdict(int)
    for entry in buffer.queued():
        queued[entry.env_id] += entry.size
    stale = status["stale_dropped"]
    rows = [
        {
            "env_id": env.env_id,
            "name": env.desired_name,
            "wandb_name": env.wandb_name,
            "connected": env.connected,
            "weight": env.weight,
            "group_size": env.group_size,
            "queued_sequences": queued.get(env.env_id, 0),
            "held_sequences": buffer.held_sequences(env.env_id),
            "stale_dropped": stale.get(str(env.env_id), 0),
        }
        for env in list(buffer.envs)
    ]
    if queued.get(None):
        rows.append(
            {
                "env_id": None,
                "name": "(no env)",
                "wandb_name": None,
                "connected": None,
                "weight": None,
                "group_size": None,
                "queued_sequences": queued[None],
                "held_sequences": 0,
                "stale_dropped": 0,
            }
        )
    return {"status": status, "envs": rows}
