"""Weights into a running inference engine, and the version back out of it.

:class:`EngineWeightPublisher` is the trainer's :class:`~rollhub.weights.WeightPublisher` for vLLM servers.
For version ``v`` it writes the weights as safetensors into a checkpoint directory (atomic, the newest
``keep_last`` kept: :class:`~rollhub.weights.checkpoint.CheckpointDirectory`), in the dtype they are given in
(torch tensors of any dtype, ``bfloat16`` included, or numpy arrays), then, on every engine:

1. ``POST /pause`` in the push mode (:data:`PUSH_MODES`): ``wait`` lets requests in flight finish on the old
   weights while new ones wait (the push waits on the longest generation); ``keep`` freezes them where they are
   and continues them on the new weights after ``/resume`` (their tokens carry two versions); ``abort`` ends them,
   returning what they sampled so far, which the client continues on the new weights
   (:class:`~rollhub.inference.openai_client.OpenAICompletionsClient` with ``continue_aborted``);
2. ``POST /collective_rpc``: every worker loads the checkpoint in ``DIR`` (same parameter names as the model's own
   checkpoint). With ``load = "in_place"`` (the default) it calls ``rollhub_load_in_place`` (the worker extension
   rollhub starts its engines with, :mod:`rollhub_vllm_worker` in ``rollhub/inference/engine_side``), which copies
   each tensor into the parameter the engine computes with; an engine that refuses it (started without the
   extension, or computing from packed copies of its weights, as vLLM-CPU does with float32) is loaded with vLLM's
   ``reload_weights`` from then on (:attr:`EngineWeightPublisher.load_fallbacks` gives each one's reason).
   ``reload_weights`` rebuilds and re-materializes every layer before copying into it: the same weights, several
   times slower at 0.5B parameters;
3. ``POST /update_weight_version`` ``{"new_version": "v"}``;
4. with ``kv = "clear"`` (the default), the cached keys and values of the old weights are dropped: ``wait`` and
   ``abort`` pause with ``clear_cache=true``; ``keep`` calls ``POST /reset_prefix_cache?reset_running_requests=true``
   while paused, which preempts the frozen requests so that on resume their prompt and tokens so far are
   recomputed by the new weights. With ``kv = "keep"`` nothing is dropped: a request continued after the push
   attends to keys and values the old weights computed, and a prompt found in the prefix cache reuses them;
5. ``POST /resume`` (also when a step before it failed, so a failed push never leaves the engine paused).

An engine that refuses ``mode=keep`` (a vLLM before the mode existed answers 4xx) is pushed in ``fallback`` mode
from then on, and :attr:`EngineWeightPublisher.fallbacks` counts it. Either way the log-probs a client receives
are those the engine computed when it sampled each token, so the importance ratio stays exact; ``kv = "keep"``
only makes the behaviour distribution drift further from the trainer's (measured in ``benchmarks/partial.py``).

With ``staging`` (a directory on tmpfs, e.g. under ``/dev/shm``: the engines must share this machine's memory),
the version the engines load is written there instead, without fsync, and the durable checkpoint is written
from that file in a background thread (:mod:`rollhub.weights.staging`: in order, a version still waiting when
a newer one arrives is skipped, a failed write raised by the next :meth:`~EngineWeightPublisher.publish` or by
:meth:`~EngineWeightPublisher.close`). The push then costs a write to memory and the engines' reload; the
durable checkpoint lags by the version being written (on a crash, by one or two versions). Only the newest
staged versions are kept, and :meth:`~EngineWeightPublisher.close` writes the last one durably and deletes the
staging directory. :meth:`~EngineWeightPublisher.reload` loads the newest version there is, staged or durable.

Each push is timed (:class:`PushTiming`: writing the version the engines load, and the engine calls);
:attr:`timings` keeps them for metrics and the run summary.

:class:`EngineVersionSubscriber` is the rollout side: the weights are already in the engine, so it only reads
the engine's weight version (``GET /weight_info``) and reports it as :attr:`loaded_version`, the
``policy_version`` the worker tags what it samples next. A request that arrives while a push is under way waits
and runs on the new weights, yet carries the version read before it: its staleness can be overstated by one,
never understated, and its log-probs are always those of the weights that sampled it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import numpy as np

from rollhub.inference.engine import EngineError
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.staging import DurableWriter, StagedVersions

INITIAL_VERSION = "default"  # what vLLM reports before any version was set
PushMode = Literal["wait", "keep", "abort"]
KvPolicy = Literal["clear", "keep"]
WeightLoad = Literal["in_place", "reload"]
PUSH_MODES: tuple[str, ...] = get_args(PushMode)
WEIGHT_LOADS: tuple[str, ...] = get_args(WeightLoad)
IN_PLACE_METHOD = "rollhub_load_in_place"  # rollhub_vllm_worker.InPlaceWeights
KV_POLICIES: tuple[str, ...] = get_args(KvPolicy)


@dataclass(frozen=True, slots=True)
class PushTiming:
    """How long one version took to reach the engines.

    Attributes:
        version: the policy version pushed.
        write_s: writing the safetensors file the engines load: the checkpoint, fsynced, or with ``staged`` the
            staged copy in memory.
        push_s: pause, reload, set the version and resume, on every engine.
        nbytes: size of the weights.
        staged: whether the engines loaded a staged copy (the durable checkpoint written in the background).
    """

    version: int
    write_s: float
    push_s: float
    nbytes: int
    staged: bool = False

    @property
    def total_s(self) -> float:
        """From the trainer's call to the last engine serving the new weights."""
        return self.write_s + self.push_s


def _call(http: httpx.Client, path: str, **kwargs: Any) -> dict[str, Any]:
    try:
        resp = http.post(path, **kwargs)
    except httpx.HTTPError as exc:
        raise EngineError(f"POST {http.base_url}{path} failed ({type(exc).__name__}: {exc}); is it up?") from None
    if resp.status_code != 200:
        hint = " (start vLLM with VLLM_SERVER_DEV_MODE=1)" if resp.status_code == 404 else ""
        raise _Refused(f"POST {http.base_url}{path} answered {resp.status_code}: {resp.text[:300]}{hint}",
                       resp.status_code)  # fmt: skip
    return resp.json() if resp.content else {}


class _Unreachable(EngineError):
    """An engine did not answer at all (not started, dead, or restarting)."""


class _Refused(EngineError):
    """An engine route answered with an error status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _nbytes(weight: Any) -> int:
    """Bytes of one tensor: a torch tensor's or numpy array's own ``nbytes`` (any dtype), else as a numpy array."""
    nbytes = getattr(weight, "nbytes", None)
    return int(nbytes) if nbytes is not None else int(np.asarray(weight).nbytes)


class EngineWeightPublisher:
    """Publishes trainer weights into running vLLM servers (see the module docstring).

    Args:
        urls: the engines' roots.
        checkpoints: where each version is written (engines must be able to read this path).
        timeout_s: per engine call (a reload of a large model takes a while).
        keep_timings: how many :class:`PushTiming` values :attr:`timings` keeps.
        transport: the HTTP transport (tests give a fake engine; default: the network).
        mode: how requests in flight meet the push (:data:`PUSH_MODES`, see the module docstring).
        kv: ``"clear"`` drops the old weights' cached keys and values at each push, ``"keep"`` keeps them.
        fallback: the mode used for an engine that refuses ``keep`` (``"wait"`` or ``"abort"``).
        staging: a directory the engines can read, in memory (tmpfs), to load each version from while the
            durable checkpoint is written in the background (see the module docstring); :meth:`close` deletes
            it. ``None``: the engines load the durable checkpoint, written and fsynced first.
        load: how an engine loads a version: ``"in_place"`` (copied into its parameters; ``"reload"`` for an
            engine that refuses it) or ``"reload"`` (vLLM's ``reload_weights``).
    """

    def __init__(self, urls: Sequence[str], checkpoints: CheckpointDirectory, timeout_s: float = 600.0,
                 keep_timings: int = 10_000, transport: httpx.BaseTransport | None = None, mode: PushMode = "wait",
                 kv: KvPolicy = "clear", fallback: PushMode = "wait",
                 staging: str | os.PathLike[str] | None = None, load: WeightLoad = "in_place") -> None:  # fmt: skip
        if not urls:
            raise EngineError("EngineWeightPublisher needs at least one engine url")
        choices = (("mode", mode, PUSH_MODES), ("kv", kv, KV_POLICIES), ("fallback", fallback, ("wait", "abort")),
                   ("load", load, WEIGHT_LOADS))  # fmt: skip
        for name, value, allowed in choices:
            if value not in allowed:
                raise EngineError(f"push {name} {value!r} is not one of {', '.join(allowed)}")
        self.checkpoints = checkpoints
        self._engines = [httpx.Client(base_url=u.rstrip("/"), timeout=timeout_s, transport=transport) for u in urls]
        self._modes: list[PushMode] = [mode] * len(urls)
        self.kv, self.fallback = kv, fallback
        self.fallbacks = 0
        self._loads: list[WeightLoad] = [load] * len(urls)
        self.load_fallbacks: list[str] = []  # why each engine that refused the in-place load refused it
        self.timings: list[PushTiming] = []
        self._keep = keep_timings
        self.staged = StagedVersions(staging) if staging is not None else None
        self.durable = DurableWriter(checkpoints, self.staged, keep_timings) if self.staged is not None else None
        self._lock = threading.RLock()  # a push and a reload never pick or retire files under each other

    @property
    def modes(self) -> list[PushMode]:
        """The mode each engine is pushed in (``keep`` turns into the fallback for an engine that refused it)."""
        return list(self._modes)

    def publish(self, version: int, weights: Mapping[str, Any], skip: Collection[int] = (),
                lost: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        """Write ``weights`` as checkpoint ``version`` and load it into every engine but those in ``skip`` (indexes
        of engines being restarted: :meth:`reload` gives them the newest checkpoint once they are up).

        ``weights`` are numpy arrays or torch tensors, written in their own dtype (a ``bfloat16`` policy's
        tensors stay ``bfloat16``): give them in the dtype the engine serves. When the push to engine ``i`` fails
        and ``lost(i)`` says the engine itself is gone (it died during the push, and will be restarted with the
        newest checkpoint), the failure is not an error: the other engines are pushed as usual.

        With ``staging``, the version is staged and loaded from memory, and its durable checkpoint is written in
        the background (also when an engine refused the push, as without staging the checkpoint is written
        first); the weights are not read after this returns, so the caller may change them.

        Raises:
            EngineError: ``version`` is not newer than the last one pushed, or an engine refused a call (its
                route, status and answer are in the message).
            CheckpointError: with ``staging``, the background write of an earlier version failed (raised once;
                this version is not pushed).
        """
        with self._lock:
            if self.timings and version <= self.timings[-1].version:
                raise EngineError(f"version {version} is not newer than the version last pushed "
                                  f"({self.timings[-1].version}); versions must increase")  # fmt: skip
            if self.durable is not None:
                self.durable.raise_error()
            started = time.perf_counter()
            path = (
                self.checkpoints.save(version, weights) if self.staged is None else self.staged.write(version, weights)
            )
            written = time.perf_counter()
            try:
                for i, http in enumerate(self._engines):
                    if i in skip:
                        continue
                    try:
                        self._push(i, http, str(path.resolve()), version)
                    except EngineError:
                        if lost is None or not lost(i):
                            raise
            finally:
                if self.durable is not None:
                    self.durable.submit(version)  # after the engines: the copy does not compete with their reload
            done = time.perf_counter()
            nbytes = int(sum(_nbytes(w) for w in weights.values()))
            timing = PushTiming(version, written - started, done - written, nbytes, self.staged is not None)
            self.timings = [*self.timings, timing][-self._keep :]

    def newest(self) -> tuple[int, Path] | None:
        """The newest version there is and the directory to load it from: staged (in memory) when it is there,
        else the durable checkpoint; ``None`` before the first push."""
        with self._lock:
            durable = self.checkpoints.latest_step()
            staged = self.staged.newest() if self.staged is not None else None
            if staged is not None and (durable is None or staged >= durable):
                return staged, self.staged.path(staged)  # type: ignore[union-attr]
            return None if durable is None else (durable, self.checkpoints.path(durable))

    def reload(self, index: int) -> int | None:
        """Load the newest version (:meth:`newest`: staged if its durable checkpoint is not written yet) into engine
        ``index`` (a restarted engine); returns its version, or ``None`` when nothing was pushed yet (the engine
        keeps the model's own weights)."""
        with self._lock:
            newest = self.newest()
            if newest is None:
                return None
            version, path = newest
            self._push(index, self._engines[index], str(path.resolve()), version)
            return version

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the durable checkpoint holds every version pushed (at once without ``staging``); ``False``
        if ``timeout_s`` passed first.

        Raises:
            CheckpointError: a background write failed (:class:`~rollhub.weights.staging.DurableWriter`).
        """
        if self.durable is None:
            return True
        done = self.durable.flush(timeout_s)
        self.durable.raise_error()
        return done

    @property
    def loads(self) -> list[WeightLoad]:
        """How each engine loads a version (``in_place`` turns into ``reload`` for an engine that refused it)."""
        return list(self._loads)

    def _load(self, index: int, http: httpx.Client, path: str) -> None:
        reload = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        if self._loads[index] == "reload":
            _call(http, "/collective_rpc", json=reload)
            return
        try:
            answer = _call(http, "/collective_rpc", json={"method": IN_PLACE_METHOD, "kwargs": {"weights_path": path}})
        except _Refused as exc:  # an engine without rollhub's worker extension (vLLM answers 500 for the method)
            why = str(exc)
        else:
            refused = [r["refused"] for r in answer.get("results") or () if isinstance(r, dict) and "refused" in r]
            if not refused:
                return
            why = refused[0]  # a layer computes from a packed copy of its weights: nothing was loaded
        self._loads[index] = "reload"
        self.load_fallbacks.append(f"engine {index}: {why}")
        try:
            _call(http, "/collective_rpc", json=reload)
        except _Refused:
            raise
        except EngineError:  # the connection the refusal's 500 closed: once more on a new one
            _call(http, "/collective_rpc", json=reload)

    def _pause(self, index: int, http: httpx.Client) -> PushMode:
        mode = self._modes[index]
        params = {"mode": mode} if mode == "keep" else {"mode": mode, "clear_cache": str(self.kv == "clear").lower()}
        try:
            _call(http, "/pause", params=params)
        except _Refused as exc:
            if mode != "keep" or exc.status not in (400, 422):
                raise
            self._modes[index] = self.fallback  # an engine without keep mode
            self.fallbacks += 1
            return self._pause(index, http)
        return mode

    def _push(self, index: int, http: httpx.Client, path: str, version: int) -> None:
        mode = self._pause(index, http)
        try:
            self._load(index, http, path)
            _call(http, "/update_weight_version", json={"new_version": str(version)})
            if mode == "keep" and self.kv == "clear":  # frozen requests recompute their keys with the new weights
                _call(http, "/reset_prefix_cache", params={"reset_running_requests": "true"})
        finally:
            _call(http, "/resume")

    def close(self) -> None:
        """Write the last staged version durably, delete the staging directory, close the connection pools.

        Raises:
            CheckpointError: a background write failed and was not raised yet (everything is closed first).
        """
        try:
            if self.durable is not None:
                self.durable.close()
        finally:
            if self.staged is not None:
                self.staged.remove()
            for http in self._engines:
                http.close()


def engine_version(http: httpx.Client) -> int | None:
    """The engine's weight version as an int (``None`` before the first push).

    Raises:
        EngineError: the engine cannot be reached, or holds a version rollhub did not set.
    """
    try:
        resp = http.get("/weight_info")
    except httpx.TransportError as exc:
        raise _Unreachable(f"GET {http.base_url}/weight_info failed ({exc}); is the engine up?") from None
    if resp.status_code != 200:
        raise EngineError(f"GET {http.base_url}/weight_info answered {resp.status_code}; is the engine up in dev "
                          "mode?")  # fmt: skip
    value = resp.json().get("weight_version")
    if value in (None, INITIAL_VERSION):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(f"the engine at {http.base_url} holds weight version {value!r}, not a rollhub version; "
                          "let one trainer push to it") from None  # fmt: skip


class EngineVersionSubscriber:
    """A :class:`~rollhub.weights.WeightSubscriber` that reads the version of the weights already in an engine.

    :meth:`poll` never returns weights (there is nothing to load in this process); it refreshes
    :attr:`loaded_version` from ``GET /weight_info``. With ``retry_for_s``, an engine that does not answer (being
    restarted) leaves the version as last read for up to that long before :meth:`poll` raises; the restarted
    engine is loaded with the newest version before it answers again.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None,
                 retry_for_s: float = 0.0) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)
        self._version: int | None = None
        self.retry_for_s = retry_for_s
        self._failing_since: float | None = None

    @property
    def loaded_version(self) -> int | None:
        """The engine's version at the last :meth:`poll` (``None`` before the first push)."""
        return self._version

    @property
    def offered_version(self) -> int | None:
        """The newest version there is: the engine's own."""
        return self._version

    def poll(self) -> None:
        """Refresh :attr:`loaded_version`; there are never weights to hand out.

        Raises:
            EngineError: the engine did not answer (for longer than ``retry_for_s``), or holds a version rollhub
                did not set.
        """
        try:
            self._version = engine_version(self._http)
        except _Unreachable:
            now = time.monotonic()
            self._failing_since = self._failing_since or now
            if now - self._failing_since >= self.retry_for_s:
                raise
            return None
        self._failing_since = None
        return None

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
