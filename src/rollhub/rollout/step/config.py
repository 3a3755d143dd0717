"""`StepManagerConfig`: how a :class:`rollhub.rollout.step.manager.StepRolloutManager` runs its environments."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollhub.envs.step import EnvSpec
from rollhub.errors import ConfigError
from rollhub.rollout.step.env_worker import Backoff, StartMethod, check_timer_slack


@dataclass(frozen=True)
class StepManagerConfig:
    """How a :class:`StepRolloutManager` runs its environments.

    Attributes:
        env: the environment recipe; every instance is built from it.
        n_envs: environment instances.
        env_processes: processes the instances are spread over (as evenly as possible; ``None``: 2, or 1 for a
            single environment). Each process steps its instances one after the other and answers with one
            message, so cheap environments want few processes (2: one half steps while the policy acts for
            the other) and slow ones, that wait or compute for milliseconds, one process each (``n_envs``).
            0 steps them in the manager's own thread, with no process and no pipe: the fastest for environments
            that take microseconds (see :class:`rollhub.rollout.step.env_worker.InlineEnvWorker`).
        fragment_length: steps per :class:`SampleFragment`.
        inference_batch_size: environments to gather before a forward pass, waiting at most ``batch_wait_s``
            for them after the first answer (``None``: all ``n_envs``).
        batch_wait_s: the longest a ready observation waits for more to batch with (0: act on what is ready).
        gamma: discount of the reported discounted return.
        seed: base seed; environment ``i`` first resets with ``seed + i``.
        wait_timeout_s: how long no environment may answer before the manager gives up.
        backoff: restart policy of the environment instances and processes.
        start_method: how environment processes start (``spawn`` or ``forkserver``; never a plain fork).
        timer_slack_ns: timer slack of the environment processes (with ``env_processes=0``: of the thread that
            steps the environments), in nanoseconds (Linux). The default, 1 µs,
            lets environments that wait on timers wake when they asked to instead of up to 50 µs later (the
            OS default for normal threads); ``None`` keeps the OS default.
        step_threads: with ``env_processes=0``, split the environments into this many vectors (as evenly as
            possible), each stepped, and its actions chosen, in a thread of its own while the caller records what
            they made (see :mod:`rollhub.rollout.step.threads`): only stepping and the forward pass stay between
            two steps, and with one thread per environment (``n_envs``) no environment waits for another's step.
            For environments that wait (a socket, a sleep, a simulator that releases the GIL); ones that compute
            in Python for their whole step (CartPole) would only trade the interpreter lock, so leave it at 0
            (off) there.
    """

    env: EnvSpec
    n_envs: int = 4
    env_processes: int | None = None
    fragment_length: int = 64
    inference_batch_size: int | None = None
    batch_wait_s: float = 0.0
    gamma: float = 0.99
    seed: int = 0
    wait_timeout_s: float = 60.0
    backoff: Backoff = field(default_factory=Backoff)
    start_method: StartMethod = "spawn"
    timer_slack_ns: int | None = 1000
    step_threads: int = 0

    def __post_init__(self) -> None:
        check_timer_slack(self.timer_slack_ns)
        if self.n_envs < 1:
            raise ConfigError(f"n_envs must be >= 1, got {self.n_envs}")
        threads = self.step_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= self.n_envs:
            raise ConfigError(f"step_threads must be a whole number in [0, n_envs={self.n_envs}] (0: off; n_envs: "
                              f"a thread per environment), got {threads!r}")  # fmt: skip
        if threads and self.env_processes != 0:
            raise ConfigError(f"step_threads step the environments in the worker: they need env_processes=0, got "
                              f"{self.env_processes}; set env_processes=0 or step_threads=0")  # fmt: skip
        procs = self.env_processes
        if procs is not None and not 0 <= procs <= self.n_envs:
            raise ConfigError(f"env_processes must be in [0, n_envs={self.n_envs}] (0: inline), got {procs}")
        batch = self.inference_batch_size
        if batch is not None and not 1 <= batch <= self.n_envs:
            raise ConfigError(f"inference_batch_size must be in [1, n_envs={self.n_envs}], got {batch}")
        if not self.batch_wait_s >= 0:
            raise ConfigError(f"batch_wait_s must be >= 0 seconds, got {self.batch_wait_s}")

    @property
    def processes(self) -> int:
        """The number of environment processes (``env_processes`` or its default)."""
        return self.env_processes if self.env_processes is not None else min(2, self.n_envs)
