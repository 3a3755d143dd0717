"""The language-model plug points of ``rollhub run``: a Hugging Face policy (``[policy] kind = "hf"``) and the
inference engine that samples it (``[inference]``, vLLM).

A run with ``policy.kind = "hf"`` trains the model with GRPO in the trainer's process (``from_pretrained``) and
samples it through vLLM: engines this run starts and stops (``inference.url`` unset), or a server someone
else runs. After every update the trainer's weights are pushed into the engines in place
(:class:`rollhub.weights.engine.EngineWeightPublisher`), cast to ``policy.dtype``; the trainer's own copy stays
float32 (:mod:`rollhub.train.precision`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from rollhub.inference.engine import DEFAULT_SPIN_S
from rollhub.run.toml import false_is_none, none_as_false

TINY = "tiny"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HFPolicyConfig(_Section):
    """``[policy]`` with ``kind = "hf"``: a Hugging Face causal language model, sampled through vLLM."""

    kind: Literal["hf"] = Field("hf", description="A Hugging Face causal LM, trained by GRPO and sampled by vLLM.")
    model: str = Field(
        TINY,
        description='A model directory (`save_pretrained` output) or a hub name; `"tiny"` builds a small random Qwen2 '
        "and a tokenizer into `RUN_DIR/model` (`rollhub.models.build_tiny_model`) first.",
    )
    tiny: dict[str, Any] = Field(
        default_factory=dict,
        description='Fields of `rollhub.models.TinyModelSpec` for `model = "tiny"` (e.g. `hidden_size`).',
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="The dtype the engine serves and every version is published in; with `bfloat16` or `float16` "
        "the trainer keeps float32 master weights and runs the loss's forward pass under autocast in this dtype. "
        "`float32` suits a CPU without bfloat16 instructions.",
    )
    max_len: int = Field(
        256, ge=8, description="The longest prompt plus completion, in tokens (the engine's `--max-model-len`)."
    )


class InferenceSection(_Section):
    """``[inference]``: the vLLM engine(s) a ``policy.kind = "hf"`` run samples from."""

    kind: Literal["vllm"] = Field("vllm", description="vLLM (the only engine so far).")
    url: str | None = Field(
        None,
        description="An engine already running (started with `VLLM_SERVER_DEV_MODE=1` and serving `policy.model`; it "
        "must read the run directory's weight checkpoints); unset: the run starts its own and stops it.",
    )
    per_worker: bool = Field(False, description="One engine per rollout worker instead of one shared by the fleet.")
    python: str | None = Field(
        None,
        description="The interpreter with vLLM (unset: `$ROLLHUB_VLLM_PYTHON`, else `.venv-vllm/bin/python`).",
    )
    kv_cache_gb: float | None = Field(
        1.0,
        gt=0,
        description="vLLM-CPU's KV cache in GiB (`VLLM_CPU_KVCACHE_SPACE`); `false`: not set, vLLM's default (on a "
        "GPU, pass `--gpu-memory-utilization` in `args` instead).",
    )
    args: list[str] = Field(default_factory=lambda: ["--enforce-eager"], description="Further engine arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="Further engine environment variables.")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long a started engine may take to answer `/health`.")
    worker_spin_s: float | None = Field(
        DEFAULT_SPIN_S,
        ge=0,
        description="Seconds the processes of an engine the run starts (its engine core and model workers) busy-wait "
        "for their next message before they sleep (rollhub's engine launcher caps vLLM's own second, which on a CPU "
        "the trainer shares keeps a core spinning between batches). Under the cap a sleeping process also looks at its "
        "queue every 50 ms rather than vLLM's 5 s, so a lost wake-up costs 50 ms (`ROLLHUB_VLLM_RECHECK_MS` in `env` "
        "sets it). `false`: vLLM's own spin and recheck.",
    )
    keep_weights: int = Field(
        2, ge=1, description="Weight checkpoints kept in `RUN_DIR/engine-weights` (the newest ones)."
    )
    push: Literal["keep", "wait", "abort"] = Field(
        "keep",
        description="How a weight push meets the generations in flight (`rollhub.weights.engine`): `keep` freezes "
        "them and continues them on the new weights, so the trainer never waits for the longest one (their tokens "
        "carry two versions); `wait` lets them finish on the old weights first; `abort` ends them and the client "
        "continues each from its tokens.",
    )
    push_fallback: Literal["wait", "abort"] = Field(
        "wait", description="The push mode for an engine that refuses `keep` (a vLLM without the mode)."
    )
    push_kv: Literal["clear", "keep"] = Field(
        "clear",
        description="At a push, `clear` drops the keys and values the old weights computed (frozen generations are "
        "recomputed on the new weights); `keep` keeps them, which is cheaper and makes tokens sampled after the push "
        "attend to the old weights' keys (their log-probs stay exact; the mismatch with the trainer grows).",
    )
    push_load: Literal["in_place", "reload"] = Field(
        "in_place",
        description="How an engine loads a pushed version (`rollhub.weights.engine`): `in_place` copies each tensor "
        "into the parameters the engine computes with (rollhub's vLLM worker extension, which every engine the run "
        "starts gets; where vLLM-CPU computes from packed copies of the weights, as in float32, the layers keep the "
        "parameters they were packed from, in memory, and are packed again), falling back to `reload` for an "
        "engine that refuses it (one at `inference.url` started without the extension); `reload` uses vLLM's "
        "`reload_weights`, which rebuilds every layer first (several times slower at 0.5B).",
    )
    push_staging: Literal["auto", "shm", "none"] = Field(
        "auto",
        description="Where the engines load each pushed version from (`rollhub.weights.staging`): `shm` stages it in "
        "memory under `/dev/shm` (no fsync) and writes the durable checkpoint in `RUN_DIR/engine-weights` in the "
        "background, so the push waits for neither the disk nor the fsync (the engine must share this machine's "
        "`/dev/shm`; the durable checkpoint may lag by a version); `none` writes and fsyncs the checkpoint first "
        "and the engines load it; `auto`: `shm` for the engines the run starts when `/dev/shm` is writable, `none` "
        "for an engine at `inference.url` (it may be on another machine, or in a container with its own "
        "`/dev/shm`: set `shm` when it shares this one).",
    )
    route: Literal["completions", "generate"] = Field(
        "completions",
        description="The engine route samples go through: `completions` (OpenAI's `/v1/completions`) or `generate` "
        "(vLLM's token route), whose answers give every token the weight version that sampled it. An engine the run "
        "starts gets `--enable-scale-out`, which serves the route; one at `inference.url` must be started with it.",
    )
    detokenize: Literal["worker", "engine"] = Field(
        "worker",
        description='Who makes the text of the token route\'s completions (`route = "generate"`): `worker` (each '
        "rollout worker, by the engine's own algorithm over the model's `tokenizer.json`, "
        "`rollhub.inference.detokenize`; the engine then returns token ids only and its API server skips the "
        "per-step detokenization, about a quarter of its CPU on a 2-core machine) or `engine`. Requests with stop "
        "strings, and a model without a `tokenizer.json`, get the engine's text either way; the completions route "
        "always does.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of each engine the run started, when it dies (`rollhub.run.supervisor`): it comes back "
        "on the same port with the newest weights while rollout clients wait; past the bound the run ends with the "
        "engine's log. 0: a dead engine ends the run. An engine at `inference.url` is never restarted.",
    )
    probe_every: int = Field(
        10,
        ge=0,
        description="Updates between two train-inference mismatch probes (`rollhub.run.probe`): each has the engine "
        "sample a few completions beside the fleet's, so probing every update slows training; 0: never.",
    )

    _unset = field_validator("kv_cache_gb", mode="before")(
        false_is_none("true is not a size; give GiB, or false to leave it to vLLM")
    )
    _unset_spin = field_validator("worker_spin_s", mode="before")(
        false_is_none("true is not a time; give seconds, or false for vLLM's own busy-wait")
    )
    _unset_as_false = field_serializer("kv_cache_gb", "worker_spin_s", when_used="json")(none_as_false)


def llm_problems(config: Any) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for Hugging Face settings that do not fit the run."""
    problems = []
    hf = config.policy.kind == "hf"
    if hf and config.env.kind == "step":
        problems.append("  policy.kind: 'hf' is for a group environment (env.kind = 'group' or 'external')")
    if hf and config.inference.url is not None and config.inference.per_worker:
        problems.append("  inference.per_worker: one given url cannot be one engine per worker; drop one of them")
    if not hf and config.inference != InferenceSection():  # a written config.toml repeats the defaults
        problems.append("  inference: only a policy.kind = 'hf' run samples through an engine; remove [inference]")
    if config.policy.kind == "hf" and config.policy.model != TINY and config.policy.tiny:
        problems.append("  policy.tiny: only used with policy.model = 'tiny'; remove it")
    return problems
