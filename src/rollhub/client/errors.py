"""Client-side errors, and the one mapping from an HTTP answer to a :class:`~rollhub.errors.RollhubError`.

The server's own error classes are reused where the meaning is the same (a 422 raises
:class:`~rollhub.errors.InvalidInput`, a 409 :class:`~rollhub.errors.NotRegistered`, ...), so a caller
catches one class whether the problem was found locally or by the server. Messages carry the server's
own words.
"""

from __future__ import annotations

from typing import Any

import httpx

from rollhub.errors import (
    Forbidden,
    InvalidInput,
    NotRegistered,
    PayloadTooLarge,
    RollhubError,
    Unauthorized,
    UnknownBatch,
    UnknownEnv,
    VersionConflict,
)


class ServerUnavailable(RollhubError):
    """The server could not be reached, or kept failing (5xx), for longer than the retry policy allows.

    Attributes:
        what: the request that failed, e.g. ``"POST /scored_data"``.
        attempts: how many times it was tried.
    """

    def __init__(self, message: str, *, what: str, attempts: int) -> None:
        super().__init__(message)
        self.what = what
        self.attempts = attempts


class RequestRejected(RollhubError):
    """The server refused a request with a 4xx status that has no more specific class.

    Attributes:
        status_code: the HTTP status the server answered.
    """

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class DeliveryError(RollhubError):
    """Scored groups that could not be delivered; they are attached so the caller can keep or resend them.

    Attributes:
        groups: the groups (``rollhub.wire.Group``) that were not accepted.
    """

    def __init__(self, message: str, *, groups: list[Any]) -> None:
        super().__init__(message)
        self.groups = groups


class PolicyVersionConflict(VersionConflict):
    """``POST /policy-version`` was refused because the version goes backwards (the server holds a later one):
    the server's :class:`~rollhub.errors.VersionConflict` as the client sees it.

    Attributes:
        policy_version: the version that was refused.
    """

    def __init__(self, message: str, *, policy_version: int) -> None:
        super().__init__(message, field="policy_version")
        self.policy_version = policy_version


class LifecycleError(RollhubError):
    """A call that the object's lifecycle state does not allow, e.g. running a handler a second time."""


class TrackerUnavailable(RollhubError):
    """A tracker whose optional dependency is not installed, e.g. ``wandb``."""


def server_message(response: httpx.Response) -> str:
    """The server's explanation in one line: ``detail`` entries as ``loc: msg``, else the body text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):
        parts = []
        for entry in detail:
            if isinstance(entry, dict):
                loc = ".".join(str(x) for x in entry.get("loc", []) if x != "body")
                msg = entry.get("msg", entry)
                parts.append(f"{loc}: {msg}" if loc else str(msg))
            else:
                parts.append(str(entry))
        return "; ".join(parts)
    return str(detail)[:500]


def detail_field(response: httpx.Response) -> str | None:
    """The first request field a 422 ``detail`` blames (``loc`` after ``body``), if any."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return None
    if not isinstance(detail, list):
        return None
    for entry in detail:
        loc = entry.get("loc", []) if isinstance(entry, dict) else []
        names = [x for x in loc if isinstance(x, str) and x != "body"]
        if names:
            return names[-1]
    return None


def raise_for_status(response: httpx.Response, what: str, *, not_found: type[RollhubError] = RequestRejected) -> None:
    """Raise the matching :class:`RollhubError` for a 4xx/5xx answer; return for 2xx/3xx.

    Args:
        response: the final answer (after retries).
        what: the request, e.g. ``"POST /ack"``, used in the message.
        not_found: the class a 404 means for this route (unknown env, unknown batch, ...).
    """
    code = response.status_code
    if code < 400:
        return
    msg = f"{what} was refused ({code}): {server_message(response)}"
    if code == 422:
        raise InvalidInput(msg + "; fix the request and send it again", field=detail_field(response))
    if code == 409:
        raise NotRegistered(msg + "; the trainer must call POST /register first")
    if code == 404:
        if not_found is RequestRejected:
            raise RequestRejected(msg, status_code=404)
        raise not_found(msg)
    if code == 401:
        raise Unauthorized(msg + "; pass api_key= or set ROLLHUB_API_KEY to the server's key")
    if code == 403:
        raise Forbidden(msg)
    if code == 413:
        raise PayloadTooLarge(msg + "; send fewer groups per request")
    if code >= 500:
        raise ServerUnavailable(msg, what=what, attempts=1)
    raise RequestRejected(msg, status_code=code)


__all__ = [
    "DeliveryError",
    "LifecycleError",
    "PolicyVersionConflict",
    "RequestRejected",
    "ServerUnavailable",
    "TrackerUnavailable",
    "UnknownBatch",
    "UnknownEnv",
    "raise_for_status",
    "server_message",
]
