"""Updates and wall seconds to the held-out target: rollhub's GRPO next to TRL's ``GRPOTrainer``, same task.

Three runs per seed, one at a time, each a fresh subprocess, interleaved (TRL, rollhub in-process, rollhub
distributed, then the next seed):

* ``trl``: TRL's ``GRPOTrainer`` (``benchmarks/grpo_peer_trl.py`` under ``.venv-trl/bin/python``, made by
  ``make trl-env``; TRL is installed for this benchmark only), sampling with plain transformers generation;
* ``rollhub_in_process``: ``rollhub demo llm --in-process`` (``rollhub run`` on the shipped llm config with the
  in-process writer: no server and no Ray, sampling through vLLM between updates);
* ``rollhub_distributed``: ``rollhub demo llm`` as shipped (the buffer server, a Ray fleet sampling through vLLM
  while the trainer trains).

All three train the same model files: for each seed the benchmark builds the tiny Qwen2 and its tokenizer as a
run with ``policy.model = "tiny"`` does (``rollhub.models.build_tiny_model`` from the config's ``policy.tiny``
and the seed) and TRL loads that directory; each rollhub run builds its own into ``RUN_DIR/model``, as
``rollhub demo llm`` does, and the benchmark stops with an error unless those files are byte for byte the
benchmark's (:func:`fingerprint`). The task is exported
from the same config (:func:`task_export`): the arithmetic environment's training and held-out prompts with
their answers, and the settings TRL's run takes from it (batch of ``groups_per_batch`` prompts x
``group_size`` completions, temperature and ``max_tokens``, ``lr`` to ``lr_final`` over ``anneal_steps``, clip,
gradient clip, evaluation interval and target). What TRL cannot match is listed in ``grpo_peer_trl.py``.

Figures per run: the updates and the run's own wall seconds at the first held-out evaluation at or above the
target (rollhub: the ``elapsed_s`` of that update's metrics row; TRL: the seconds since its script started,
at that evaluation; both clocks include model loading, their evaluations and, for rollhub, starting the vLLM
engine and the fleet); a run that stops first is "not reached" and shows its final accuracy. Medians count a
run not reached as slower than any that reached. The ratios are rollhub / TRL, per seed and of the medians;
the goal is a median wall-time ratio of at most 1.

Run: ``python benchmarks/grpo_peer.py [--seeds 3] [--max-seconds S] [--json]`` (``make bench-peer``; needs
``.venv-vllm`` and ``.venv-trl``). ``--quick`` checks the plumbing only: one seed, 4 updates, an evaluation
every 2, at most 170 s a run. Three seeds take up to six hours here, so the runs can be made a few at a time:
``--seed 1 --variants trl --work-dir DIR`` runs only those, into ``DIR/trl-s1``, and ``--table DIR [DIR...]``
runs nothing and prints the table (and ``--json`` line) of every run the work directories hold, a run that
left no summary (killed, or stopped by hand) counting as failed with its last evaluation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollhub.run.llm import MODEL_DIR  # where a run with policy.model = "tiny" builds the model

ROOT = Path(__file__).resolve().parents[1]
TRL_SCRIPT = Path(__file__).with_name("grpo_peer_trl.py")
DEFAULT_TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
VARIANTS = ("trl", "rollhub_in_process", "rollhub_distributed")
ROLLHUB_VARIANTS = {"rollhub_in_process": ["--in-process"], "rollhub_distributed": []}
QUICK_SETS = ("run.max_updates=4", "eval.every=2")
QUICK_MAX_SECONDS = 170.0
SAMPLING_KEYS = {"temperature", "max_tokens"}  # [sampling] keys the TRL side takes over


class PeerError(Exception):
    """The config cannot be reproduced on the TRL side; the message names the key and what to do."""


def load_llm_config(sets: Sequence[str] = ()) -> Any:
    """The shipped llm config (``rollhub demo llm``'s) under ``sets`` (``KEY=VALUE``, as ``--set`` takes)."""
    from rollhub.run.config import load_config
    from rollhub.run.main import shipped_config

    return load_config(shipped_config("llm"), list(sets), source="the llm config")


def task_export(config: Any) -> dict[str, Any]:
    """The task and settings TRL's run needs, from a group run ``config`` with one arithmetic lesson.

    Returns:
        ``train`` and ``eval``: ``[prompt, answer]`` pairs (every training problem; the held-out problems the
        run evaluates on, all of them unless ``eval.n_examples`` is set); ``settings``: the batch shape,
        sampling, optimizer schedule, clip, evaluation and limits (see ``grpo_peer_trl.py``).

    Raises:
        PeerError: a setting the TRL side cannot reproduce (the key is named).
    """
    from rollhub.envs.group.arithmetic import ArithmeticEnv
    from rollhub.envs.group.spec import load_environment_from_spec
    from rollhub.run.group_parts import curriculum_config

    curriculum = curriculum_config(config)
    if curriculum is None or len(curriculum.lessons) != 1:
        raise PeerError("env: the benchmark needs exactly one lesson (the llm config's env); remove [curriculum]")
    lesson = curriculum.lessons[0]
    env = load_environment_from_spec(lesson.env_spec, dict(lesson.env_args))
    if not isinstance(env, ArithmeticEnv):
        raise PeerError(f"env.id: the benchmark exports the arithmetic environment, not {lesson.env_spec!r}")
    t = config.trainer
    sampling = config.sampling.overrides()
    if set(sampling) - SAMPLING_KEYS:
        raise PeerError(f"sampling: {sorted(set(sampling) - SAMPLING_KEYS)} are not passed to TRL; remove them")
    max_updates, anneal = config.run.max_updates, t.anneal_steps
    cosine = anneal > 0 and t.lr_final is not None
    if max_updates is None or (cosine and max_updates > anneal):
        raise PeerError(f"run.max_updates: must be set and at most trainer.anneal_steps ({anneal}), the length "
                        "of TRL's cosine schedule")  # fmt: skip
    if config.eval.target_accuracy is None:
        raise PeerError("eval.target_accuracy: the benchmark measures time to it; set one (e.g. 0.9)")
    held_out = env.eval_problems[: config.eval.n_examples] if config.eval.n_examples else env.eval_problems
    entropy_cosine = anneal > 0 and t.entropy_coef_final is not None
    if t.entropy_coef == 0.0 and entropy_cosine and t.entropy_coef_final != 0.0:
        raise PeerError("trainer.entropy_coef: TRL switches its entropy bonus on only when it starts above 0; start "
                        "it above 0 or keep trainer.entropy_coef_final at 0")  # fmt: skip
    settings = {
        "group_size": config.env.group_size,
        "groups_per_batch": t.groups_per_batch,
        "temperature": float(sampling.get("temperature", env.temperature)),
        "max_tokens": int(sampling.get("max_tokens", env.width + 1)),
        "lr": t.lr,
        "lr_final": t.lr_final if cosine else t.lr,
        "anneal_steps": anneal if cosine else 0,
        "epochs": t.epochs,
        "clip_eps": t.clip_eps,
        "max_grad_norm": t.max_grad_norm,
        "eval_every": config.eval.every,
        "target": config.eval.target_accuracy,
        "max_updates": max_updates,
        "max_seconds": config.run.max_seconds,
        "entropy_coef": t.entropy_coef,
        "entropy_coef_final": t.entropy_coef_final if entropy_cosine else t.entropy_coef,
        "entropy_anneal_steps": anneal if entropy_cosine else 0,
        "not_matched": {
            "correction": t.correction,
            "dual_clip": t.dual_clip,
        },
    }
    return {
        "train": [[env.prompt(a, b), env.answer(a, b)] for a, b in env.train_problems],
        "eval": [[env.prompt(a, b), env.answer(a, b)] for a, b in held_out],
        "settings": settings,
    }


def build_model(config: Any, seed: int, directory: Path) -> Path:
    """The tiny model of ``config.policy.tiny`` for ``seed``, built into ``directory/model`` as a run with
    ``policy.model = "tiny"`` builds it."""
    from rollhub.run.llm import model_directory
    from rollhub.run.rundir import RunDirectory

    return Path(model_directory(config.policy, seed, RunDirectory(directory)))


def fingerprint(directory: Path) -> str:
    """A SHA-256 over the names and contents of the files in ``directory`` (a run must not change the model)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (none when it is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(summary: dict[str, Any], rows: list[dict[str, Any]], command_s: float | None) -> dict[str, Any]:
    """One run's figures from its ``summary.json`` and ``metrics.jsonl`` rows (rollhub's and the TRL script's
    share the keys read here).

    Returns:
        ``reached``; ``updates`` and ``wall_s`` at the first evaluation at or above the target (``None`` when
        not reached: the elapsed seconds of the metrics row of that version, else the summary's ``wall_s``);
        ``final_accuracy``, ``steps``, ``run_wall_s`` (the whole run by its own clock) and ``command_s``.
    """
    step = summary.get("target_reached_at_step")
    wall = None
    if step is not None:
        row = next((r for r in rows if r.get("version") == step), None)
        wall = float(row["elapsed_s"]) if row is not None else float(summary["wall_s"])
    return {
        "reached": step is not None,
        "updates": step,
        "wall_s": wall,
        "final_accuracy": summary.get("eval_accuracy"),
        "steps": summary.get("steps"),
        "run_wall_s": summary.get("wall_s"),
        "command_s": None if command_s is None else round(command_s, 1),
    }


def failed(message: str, command_s: float | None, rows: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The figures of a run that wrote no summary: not reached, with ``message`` as its error; how far it got
    (``final_accuracy``, ``steps``, ``run_wall_s``) from the last held-out evaluation in its metrics ``rows``."""
    last = next((r for r in reversed(rows) if r.get("eval_accuracy") is not None), None)
    return {"reached": False, "updates": None, "wall_s": None,
            "final_accuracy": None if last is None else last["eval_accuracy"],
            "steps": None if last is None else last.get("version"),
            "run_wall_s": None if last is None else last.get("elapsed_s"),
            "command_s": None if command_s is None else round(command_s, 1), "error": message}  # fmt: skip


def _run(cmd: list[str], out: Path, summary_path: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd``, its output to ``out/command.log``; the figures from ``summary_path`` and ``out``'s metrics."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "command.log"
    start = time.perf_counter()
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = f"killed after {timeout_s:.0f} s"
    command_s = time.perf_counter() - start
    if not summary_path.exists():
        tail = log.read_text()[-1500:]
        print(f"{label}: no summary (exit {code}); the end of {log}:\n{tail}", file=sys.stderr)
    return read_run(out, summary_path, command_s, f"no summary (exit {code}); see {log}")


def read_run(out: Path, summary_path: Path, command_s: float | None, missing: str) -> dict[str, Any]:
    """The figures of the run in ``out``: from ``summary_path`` and its metrics, or, without a summary, a failed
    run (``missing`` says why) with how far its metrics got."""
    rows = read_rows(out / "metrics.jsonl")
    if not summary_path.exists():
        return failed(missing, command_s, rows)
    return figures(json.loads(summary_path.read_text()), rows, command_s)


def summary_name(variant: str) -> str:
    """The file a run of ``variant`` writes its summary to, in its run directory."""
    return "summary.json" if variant == "trl" else "summary-peer.json"


def run_dir(work: Path, variant: str, seed: int) -> Path:
    """Where the run of ``variant`` for ``seed`` writes, under the benchmark's work directory."""
    return work / f"{variant}-s{seed}"


def read_work_dir(work: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """The figures of every run an earlier benchmark left in ``work`` (directories ``VARIANT-sSEED``), read from
    its files as the benchmark reads them after a run (no command seconds: ``command_s`` is ``None``). A run
    without a summary (stopped, killed, or still running) counts as failed, with how far its metrics got.

    Raises:
        FileNotFoundError: ``work`` is not a directory.
    """
    if not work.is_dir():
        raise FileNotFoundError(f"{work}: not a directory (give the --work-dir of an earlier run)")
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for variant in VARIANTS:
        for out in sorted(work.glob(f"{variant}-s*")):
            seed = out.name.removeprefix(f"{variant}-s")
            if not out.is_dir() or not seed.isdigit():
                continue
            f = read_run(out, out / summary_name(variant), None, f"no summary in {out}")
            found.setdefault(variant, {})[int(seed)] = f
    return found


def run_trl(python: Path, task: Path, model: Path, seed: int, out: Path, max_seconds: float,
            threads: int) -> dict[str, Any]:  # fmt: skip
    """One TRL run (``grpo_peer_trl.py`` under ``python``)."""
    cmd = [str(python), str(TRL_SCRIPT), "--task", str(task), "--model", str(model), "--out-dir", str(out),
           "--seed", str(seed), "--max-seconds", str(max_seconds), "--threads", str(threads)]  # fmt: skip
    return _run(cmd, out, out / summary_name("trl"), f"trl seed {seed}", max_seconds + 600)


def run_rollhub(variant: str, model: Path, seed: int, out: Path, max_seconds: float,
                sets: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """One ``rollhub demo llm`` run of ``variant``.

    Raises:
        RuntimeError: the model the run built (``out/model``) is not the files in ``model`` (TRL's).
    """
    summary = out / summary_name(variant)
    cmd = [sys.executable, "-m", "rollhub", "demo", "llm", *ROLLHUB_VARIANTS[variant], "--seed", str(seed),
           "--out-dir", str(out), "--max-seconds", str(max_seconds), "--no-progress", "--summary-json",
           str(summary)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    figures = _run(cmd, out, summary, f"{variant} seed {seed}", max_seconds + 600)
    built = out / MODEL_DIR
    if built.is_dir() and fingerprint(built) != fingerprint(model):
        raise RuntimeError(f"{variant} seed {seed} trained a model ({built}) other than TRL's ({model})")
    return figures


def _order(value: float | None) -> float:
    """A figure as a number to sort by: not reached (``None``) after every reached one."""
    return math.inf if value is None else float(value)


def median(values: Sequence[float | None]) -> float | None:
    """The median, a run not reached counting as slower than any reached; ``None`` when the median run did not
    reach the target (for an even count: when either middle run did not)."""
    m = statistics.median([_order(v) for v in values])
    return None if math.isinf(m) else m


def ratio(rollhub: float | None, trl: float | None) -> float | None:
    """``rollhub / trl``; ``inf`` when only TRL reached, 0 when only rollhub did, ``None`` when neither did."""
    if rollhub is None and trl is None:
        return None
    if rollhub is None:
        return math.inf
    if trl is None:
        return 0.0
    return rollhub / trl


def jsonable(value: Any) -> Any:
    """``value`` with every infinite ratio written as the string ``"inf"`` (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.{digits}f}"


def _run_cells(f: dict[str, Any]) -> tuple[str, str, str]:
    """The updates and wall-seconds cells of one run, and a note for a run that did not reach the target."""
    final = "-" if f["final_accuracy"] is None else f"{f['final_accuracy']:.3f}"
    if f.get("error"):
        got = f"; last evaluation {final} at update {f['steps']}, {_cell(f['run_wall_s'])} s"
        return "failed", "-", f["error"] + ("" if f["steps"] is None else got)
    if not f["reached"]:
        note = f"not reached in budget: final accuracy {final} after {f['steps']} updates, {_cell(f['run_wall_s'])} s"
        return "not reached", "-", note
    return str(f["updates"]), _cell(f["wall_s"]), ""


Results = dict[str, dict[int, dict[str, Any]]]  # variant -> seed -> one run's figures


def summarize(results: Results, target: float) -> dict[str, Any]:
    """Medians per variant (over its seeds) and the rollhub / TRL ratios (per seed both ran, and of the medians),
    and whether each rollhub variant meets the goal (median wall seconds to the target at most TRL's)."""
    out: dict[str, Any] = {"target": target, "medians": {}, "ratios": {}, "goal_met": {}}
    for variant, runs in results.items():
        out["medians"][variant] = {"seeds": sorted(runs),
                                   "updates": median([r["updates"] for r in runs.values()]),
                                   "wall_s": median([r["wall_s"] for r in runs.values()])}  # fmt: skip
    trl = results.get("trl", {})
    for variant in results:
        if variant == "trl" or not trl:
            continue
        runs, med = results[variant], out["medians"]
        paired = [seed for seed in sorted(runs) if seed in trl]
        out["ratios"][variant] = {
            "seeds": paired,
            "wall_s_per_seed": [ratio(runs[seed]["wall_s"], trl[seed]["wall_s"]) for seed in paired],
            "updates_per_seed": [ratio(runs[seed]["updates"], trl[seed]["updates"]) for seed in paired],
            "wall_s_median": ratio(med[variant]["wall_s"], med["trl"]["wall_s"]),
            "updates_median": ratio(med[variant]["updates"], med["trl"]["updates"]),
        }
        wall = out["ratios"][variant]["wall_s_median"]
        out["goal_met"][variant] = wall is not None and wall <= 1.0
    return out


def table(results: Results, target: float) -> str:
    """The printed table: per seed and variant the updates and wall seconds to ``target`` (or why not) and the
    ratio to TRL's run of that seed; then the medians (over the seeds each variant ran) and their ratios."""
    s = summarize(results, target)
    to = f"to {target:g}"
    lines = [f"{'seed':>6}  {'variant':21} {f'updates {to}':>16} {f'wall s {to}':>14}   ratio vs TRL (wall, updates)"]
    for seed in sorted({seed for runs in results.values() for seed in runs}):
        for variant, runs in results.items():
            if seed not in runs:
                continue
            updates, wall, note = _run_cells(runs[seed])
            rel = ""
            if variant in s["ratios"] and seed in s["ratios"][variant]["seeds"]:
                r, i = s["ratios"][variant], s["ratios"][variant]["seeds"].index(seed)
                rel = f"{_cell(r['wall_s_per_seed'][i], 2)}, {_cell(r['updates_per_seed'][i], 2)}"
            line = f"{seed:>6}  {variant:21} {updates:>16} {wall:>14}   {rel:28}  {note}"
            lines.append(line.rstrip())
    for variant in results:
        m = s["medians"][variant]
        updates = "not reached" if m["updates"] is None else f"{m['updates']:.0f}"
        wall = "not reached" if m["wall_s"] is None else f"{m['wall_s']:.1f}"
        rel = ""
        if variant in s["ratios"]:
            r = s["ratios"][variant]
            rel = f"{_cell(r['wall_s_median'], 2)}, {_cell(r['updates_median'], 2)}"
        of = f"of {len(m['seeds'])}"
        lines.append(f"{'median':>6}  {variant:21} {updates:>16} {wall:>14}   {rel:28}  {of} seeds".rstrip())
    for variant, met in s["goal_met"].items():
        lines.append(f"goal ({variant} median wall s to {target:g} <= TRL's): {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; --quick: 1)")
    p.add_argument("--seed", dest="seed_list", type=int, action="append", default=None, metavar="S",
                   help="run seed S (repeatable) instead of 0..N-1, a few seeds at a time")  # fmt: skip
    p.add_argument("--max-seconds", type=float, default=None,
                   help="each run's limit (default: the config's run.max_seconds; --quick: 170)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a short smoke of the plumbing: 4 updates, eval every 2")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="which runs (all)")
    p.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON, help="TRL's interpreter (.venv-trl)")
    p.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL run (1, as rollhub's trainer)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the llm config in every run (TRL takes what task_export reads)")  # fmt: skip
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where runs write, one directory per variant and seed (default: a temp dir)")  # fmt: skip
    p.add_argument("--table", type=Path, nargs="+", default=None, metavar="WORK_DIR",
                   help="run nothing: the table of the runs earlier benchmarks left in these --work-dirs (a later "
                        "directory's run of a variant and seed replaces an earlier one's)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="end with one JSON line: every run's figures and the ratios")
    return p.parse_args(argv)


def report(results: Results, target: float, **settings: Any) -> str:
    """The ``--json`` line: ``settings``, every run's figures (variant -> seed -> figures) and the summary."""
    runs = {variant: {str(seed): f for seed, f in sorted(by_seed.items())} for variant, by_seed in results.items()}
    return json.dumps(jsonable({**settings, "runs": runs, **summarize(results, target)}))


def show_tables(work_dirs: Sequence[Path], sets: Sequence[str], as_json: bool) -> int:
    """``--table``: the table (and ``--json`` line) of the runs left in ``work_dirs``; 2 when one is missing."""
    results: Results = {}
    try:
        for work in work_dirs:
            for variant, by_seed in read_work_dir(work).items():
                results.setdefault(variant, {}).update(by_seed)
    except FileNotFoundError as exc:
        print(f"grpo_peer: {exc}", file=sys.stderr)
        return 2
    if not results:
        print(f"grpo_peer: no runs (VARIANT-sSEED directories) in {', '.join(map(str, work_dirs))}", file=sys.stderr)
        return 2
    target = load_llm_config(sets).eval.target_accuracy
    results = {v: results[v] for v in VARIANTS if v in results}
    print(table(results, target))
    if as_json:
        print(report(results, target, work_dirs=[str(w) for w in work_dirs], sets=list(sets)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every run wrote its figures, 1 when one failed, 2 for a bad setup."""
    args = parse_args(argv)
    if args.table:
        return show_tables(args.table, args.sets, args.json)
    count = args.seeds if args.seeds is not None else 1 if args.quick else 3
    seeds = list(dict.fromkeys(args.seed_list)) if args.seed_list else list(range(count))
    if not seeds or min(seeds) < 0:
        print("--seeds must be >= 1 and every --seed >= 0", file=sys.stderr)
        return 2
    sets = [*(QUICK_SETS if args.quick else ()), *args.sets]
    config = load_llm_config(sets)
    max_seconds = args.max_seconds or (QUICK_MAX_SECONDS if args.quick else config.run.max_seconds)
    if "trl" in args.variants and not args.trl_python.exists():
        print(f"{args.trl_python} not found: run `make trl-env` (TRL in .venv-trl), or pass --trl-python",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        task = task_export(config)
    except PeerError as exc:
        print(f"grpo_peer: {exc}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="grpo-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    task_path = work / "task.json"
    task_path.write_text(json.dumps(task))
    print(f"work dir {work}; {len(task['train'])} training and {len(task['eval'])} held-out problems; "
          f"settings {json.dumps(task['settings'])}", flush=True)  # fmt: skip
    results: Results = {v: {} for v in VARIANTS if v in args.variants}
    for seed in seeds:
        model = build_model(config, seed, work / f"model-s{seed}")
        before = fingerprint(model)
        for variant in results:
            out = run_dir(work, variant, seed)
            if variant == "trl":
                f = run_trl(args.trl_python, task_path, model, seed, out, max_seconds, args.trl_threads)
            else:
                f = run_rollhub(variant, model, seed, out, max_seconds, sets)
            if fingerprint(model) != before:
                raise RuntimeError(f"{variant} seed {seed} changed the model files in {model}")
            if variant != "trl" and not (out / MODEL_DIR).is_dir():
                print(f"{variant} seed {seed}: built no model to compare with TRL's", file=sys.stderr)
            results[variant][seed] = f
            print(f"{variant} seed {seed}: {json.dumps(f)}", flush=True)
    target = task["settings"]["target"]
    print(table(results, target))
    if args.json:
        print(report(results, target, seeds=seeds, max_seconds=max_seconds, quick=args.quick, sets=sets,
                     trl_threads=args.trl_threads))  # fmt: skip
    return 1 if any(r.get("error") for runs in results.values() for r in runs.values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
