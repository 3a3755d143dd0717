"""What ``/docs`` and ``/redoc`` say about each route: a summary and a description (Markdown), and the bearer
security scheme behind their Authorize button.

The texts live here, in one table, rather than in the routes' docstrings, so that the routes' code stays
readable and a route added without an entry is caught by the schema tests (:func:`document` leaves FastAPI's
generated summary and no description).
"""

from __future__ import annotations

from typing import Any

#: The security scheme of every route that needs the API key (named in each operation's ``security``).
BEARER = "bearer"
SECURITY_SCHEMES: dict[str, Any] = {
    BEARER: {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's API key, sent as `Authorization: Bearer KEY`. Only a server started with "
        "`--api-key KEY` (or `ROLLHUB_API_KEY`) checks it; without one, every route is open.",
    }
}

_WAIT = (
    'Until the trainer\'s first `GET /batch` the answer is `200 {"status": "wait for trainer to start"}` '
    "and nothing is registered (AtroposLib's rule): register again after the trainer starts. Groups posted with "
    "an `env_id` the server never issued are refused with 422, whose message says so."
)

#: (method, path) -> (summary, description)
ROUTES: dict[tuple[str, str], tuple[str, str]] = {
    ("get", "/"): ("Liveness", 'Answers `{"message": "AtroposLib API"}`; open without the API key.'),
    ("post", "/register"): (
        "Register the trainer",
        "The trainer announces its run: batch size (sequences per batch), max token length, W&B group and "
        "project, checkpoint directory and interval, starting step and number of steps. Answers a fresh `uuid`. "
        "A later call updates these parameters but keeps the queue, the environments and the step, so a "
        "restarted trainer loses nothing.",
    ),
    ("get", "/wandb_info"): ("W&B group and project", "The trainer's W&B group and project (null before `/register`)."),
    ("get", "/info"): (
        "Batch size and max token length",
        "The trainer's batch size (in sequences) and max token length; -1 before `/register`.",
    ),
    ("get", "/status"): (
        "Queue status",
        "AtroposLib's `current_step` and `queue_size` (queued groups), then rollhub's figures: queued and held "
        "sequences, leased batches, bounds, stale items dropped, storage and the published policy version.",
    ),
    ("get", "/reset_data"): (
        "Start a new run",
        "Forgets everything: queued, held and leased items, the trainer's registration, the environments, the "
        "step and the published policy version; the next `/register` starts a new run. Answers 403 on a server "
        "started with `--no-reset`.",
    ),
    ("post", "/register-env"): (
        "Register a rollout environment",
        "A rollout handler announces itself (name, weight, group size, max token length, optional minimum "
        f"share of every batch) and gets its `env_id` and a unique W&B run name. {_WAIT}",
    ),
    ("post", "/disconnect-env"): (
        "Disconnect an environment",
        "Marks the env disconnected: its minimum batch share no longer applies and its id is never reused. An "
        'env_id never issued answers `{"status": "failure", ...}` as AtroposLib does.',
    ),
    ("get", "/status-env"): (
        "Status of one environment",
        'Give the env as `?env_id=N` or (as AtroposLib clients send it) a JSON body `{"env_id": N}`. Queue '
        "sizes are in units of this env's group size, as in AtroposLib; 404 for an env_id never issued.",
    ),
    ("post", "/scored_data"): (
        "Send one scored group",
        "One group of scored sequences, as JSON or msgpack (`Content-Type: application/msgpack`), optionally "
        "gzip-compressed. A group smaller than its env's group size is held until the env's parts make a whole "
        "group. Answers 429 with `Retry-After` when the queue is full; nothing is stored on any error.",
    ),
    ("post", "/scored_data_list"): (
        "Send several scored groups",
        "A list of groups in one request, stored all or none (same rules as `/scored_data`).",
    ),
    ("get", "/latest_example"): ("The latest group", "The last group queued, or empty lists before any."),
    ("get", "/batch"): (
        "Take a batch (trainer)",
        "A batch of the trainer's batch size, or `batch: null` when none is ready yet. `wait_s` long-polls up to "
        "that long; `lease_s` leases the batch, which is served again unless acknowledged with `POST /ack` in "
        "time. `Accept: application/msgpack` answers in msgpack. The first call marks the trainer started, after "
        "which environments may register. Before `/register`, AtroposLib's error object.",
    ),
    ("get", "/health"): ("Health", "`ok`, the storage URL, whether it is durable, and the step; open without a key."),
    ("post", "/ack"): (
        "Acknowledge a leased batch",
        "Confirms the batch of `batch_id` (from `GET /batch?lease_s=...`): it will not be served again.",
    ),
    ("post", "/policy-version"): (
        "Publish the trainer's policy version",
        "The number of weight updates the trainer has published. From now on the staleness bound "
        "(`--max-staleness`) compares against it; queued items it makes too stale are dropped at once.",
    ),
    ("post", "/fleet"): (
        "Report a rollout fleet's figures",
        "A rollout fleet's figures (`rollhub run` posts them every few seconds), kept as the fleet's latest "
        "report for `/metrics` (`rollhub_fleet_*`) and the dashboard.",
    ),
    ("get", "/dashboard"): (
        "Live dashboard page",
        "A page of the queue and of every environment by name, polling `/dashboard/data`. Open without the API "
        "key (it holds no data); it asks for the key when the server needs one.",
    ),
    ("get", "/dashboard/data"): (
        "Dashboard data",
        "What the dashboard polls: `/status`, counters and histograms since the server started, one row per "
        "environment named as it registered, and the latest report of every rollout fleet.",
    ),
    ("get", "/metrics"): (
        "Prometheus metrics",
        "The buffer's, the server's and the rollout fleets' figures as Prometheus text.",
    ),
}


def document(path: str, method: str, operation: dict[str, Any], protected: bool) -> None:
    """Give ``operation`` its summary and description from :data:`ROUTES` and, when ``protected``, the bearer
    scheme as its security requirement."""
    summary_description = ROUTES.get((method, path))
    if summary_description is not None:
        operation["summary"], operation["description"] = summary_description
    if protected:
        operation["security"] = [{BEARER: []}]
