"""The TRL side of ``benchmarks/grpo_peer.py``: TRL's ``GRPOTrainer`` on the task that script exports.

Run by that script with ``.venv-trl/bin/python`` (``make trl-env``); it imports TRL, transformers, datasets and
torch only, never rollhub, and reads everything it trains on from the task file the benchmark writes: the
training and held-out prompts with their answers, and the settings taken from rollhub's llm config (batch shape,
sampling, learning rate schedule, clip, evaluation interval, target, limits). The model is the directory the
benchmark built with rollhub's ``build_tiny_model``, the same one rollhub's runs of that seed load.

What matches rollhub's run: Adam (AdamW without weight decay) at ``lr`` falling along a cosine to ``lr_final``
over ``anneal_steps`` updates (``cosine_with_min_lr`` over ``max_steps = anneal_steps``; the benchmark refuses
``max_updates`` above it; with ``anneal_steps = 0`` a constant rate), gradients clipped to ``max_grad_norm``,
one update per batch of ``groups_per_batch`` prompts x ``group_size`` completions, ``epochs`` passes over it
(``num_iterations``; 1 in the llm config), the ratio clipped to ``1 +- clip_eps``, advantages scaled by the
group's standard deviation, the loss averaged over every completion token of the batch (``loss_type =
"dapo"``), no KL term, sampling at the environment's temperature with no truncation for ``max_tokens`` tokens,
and the same entropy bonus: ``entropy_coef`` times the mean entropy of the sampling distribution over the batch's
completion tokens, subtracted from the loss (TRL's ``entropy_coef``), its weight moved along rollhub's half cosine
toward ``entropy_coef_final`` over ``entropy_anneal_steps`` updates when the config anneals it (:func:`annealed`,
set on the trainer before each update). The reward is :func:`score`, the arithmetic environment's rule. Not
available in TRL, so not matched: rollhub's off-policy correction and dual clip (TRL's batches are on-policy here),
and its group standard deviation (TRL divides by the sample one, over n - 1: with groups of 16 its advantages are
3% smaller).

Held-out accuracy is measured as rollhub measures it: greedy, ``max_tokens`` tokens, every held-out prompt, an
exact answer that ended with the end-of-sequence token counts, before the first update and every
``eval_every`` updates; training stops at the first evaluation at or above the target, at ``max_updates`` or
after ``max_seconds``. The clock starts when this script has imported its libraries, before the model is
loaded (rollhub's run clock likewise starts before its model and engine). Writes ``metrics.jsonl`` (one row per
evaluation: ``version``, ``eval_accuracy``, ``elapsed_s``) and ``summary.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any


def score(text: str, stopped: bool, answer: str) -> tuple[float, bool]:
    """Reward and exactness of one completion: 1 for the exact answer ended by end-of-sequence, else half the
    share of answer positions the text has right (the arithmetic environment's rule).

    Args:
        text: the completion's text, special tokens left out.
        stopped: whether the completion ended with the end-of-sequence token (not by the length limit).
        answer: the expected text.
    """
    if stopped and text == answer:
        return 1.0, True
    hits = sum(1 for i, ch in enumerate(answer) if i < len(text) and text[i] == ch)
    return 0.5 * hits / len(answer), False


def annealed(start: float, final: float, steps: int, step: int) -> float:
    """``start`` moved along a half cosine toward ``final`` at ``step`` of ``steps`` (constant when ``steps`` is 0),
    as rollhub's trainer anneals its entropy weight."""
    if steps <= 0:
        return start
    done = min(1.0, step / steps)
    return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * done))


def first_at_target(rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation row whose ``eval_accuracy`` reaches ``target``, or ``None``."""
    return next((r for r in rows if r.get("eval_accuracy") is not None and r["eval_accuracy"] >= target), None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", type=Path, required=True, help="the task file benchmarks/grpo_peer.py wrote")
    p.add_argument("--model", type=Path, required=True, help="the model directory (build_tiny_model's output)")
    p.add_argument("--out-dir", type=Path, required=True, help="where metrics.jsonl and summary.json go")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and the prompt order (0)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (the task's otherwise)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train until the target, a limit or the update budget; 0 when the target was reached, else 1."""
    args = parse_args(argv)
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    task = json.loads(args.task.read_text())
    s = task["settings"]
    max_seconds = args.max_seconds if args.max_seconds is not None else s["max_seconds"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = args.out_dir / "metrics.jsonl"
    metrics_path.write_text("")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    train = Dataset.from_list([{"prompt": p, "answer": a} for p, a in task["train"]])
    held_out = task["eval"]

    def reward(completions: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any) -> list[float]:
        return [score(text, bool(ids) and ids[-1] == eos, a)[0]
                for text, ids, a in zip(completions, completion_ids, answer, strict=True)]  # fmt: skip

    def evaluate(net: Any) -> float:
        """Greedy exact-answer accuracy over every held-out prompt (left-padded, one batch)."""
        was_training = net.training
        net.eval()
        enc = tokenizer([p for p, _ in held_out], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            greedy = {"do_sample": False, "top_p": None, "top_k": None, "temperature": None}
            out = net.generate(**enc, max_new_tokens=s["max_tokens"], eos_token_id=eos,
                               pad_token_id=tokenizer.pad_token_id, **greedy)  # fmt: skip
        correct = 0
        for row, (_, answer) in zip(out[:, enc["input_ids"].shape[1] :].tolist(), held_out, strict=True):
            stopped = eos in row
            ids = row[: row.index(eos)] if stopped else row
            correct += score(tokenizer.decode(ids, skip_special_tokens=True), stopped, answer)[1]
        if was_training:
            net.train()
        return correct / len(held_out)

    rows: list[dict[str, Any]] = []

    def record(version: int, net: Any) -> float:
        accuracy = evaluate(net)
        elapsed = round(time.perf_counter() - started, 3)
        row = {"version": version, "eval_accuracy": round(accuracy, 6), "elapsed_s": elapsed}
        rows.append(row)
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return accuracy

    stop = {"reason": "max updates"}

    class EntropyWeight(TrainerCallback):
        """Sets the entropy bonus's weight for the coming update (rollhub's schedule; TRL's own is constant)."""

        def on_step_begin(self, _args: Any, state: Any, control: Any, **_: Any) -> None:
            trainer.entropy_coef = annealed(s["entropy_coef"], s["entropy_coef_final"], s["entropy_anneal_steps"],
                                            state.global_step)  # fmt: skip

    class HeldOut(TrainerCallback):
        """Evaluates before the first update and every ``eval_every`` updates; stops at the target or the time
        limit."""

        def on_train_begin(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            record(0, model)

        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if state.global_step % s["eval_every"] == 0 and record(state.global_step, model) >= s["target"]:
                stop["reason"] = "target reached"
                control.should_training_stop = True
            elif state.global_step >= s["max_updates"]:
                control.should_training_stop = True
            elif time.perf_counter() - started >= max_seconds:
                stop["reason"] = "time limit"
                control.should_training_stop = True

    cosine = s["anneal_steps"] > 0
    config = GRPOConfig(
        output_dir=str(args.out_dir / "trl"),
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        learning_rate=s["lr"],
        lr_scheduler_type="cosine_with_min_lr" if cosine else "constant",
        lr_scheduler_kwargs={"min_lr": s["lr_final"]} if cosine else {},
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"],
        max_steps=s["anneal_steps"] if cosine else s["max_updates"],  # the schedule's length; the callback stops
        # at max_updates
        per_device_train_batch_size=s["groups_per_batch"] * s["group_size"],
        gradient_accumulation_steps=1,
        num_generations=s["group_size"],
        num_iterations=s["epochs"],
        epsilon=s["clip_eps"],
        beta=0.0,
        entropy_coef=s["entropy_coef"],
        loss_type="dapo",
        scale_rewards="group",
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        max_completion_length=s["max_tokens"],
        disable_dropout=True,
        logging_steps=s["eval_every"],
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[HeldOut(), EntropyWeight()])  # fmt: skip
    trainer.train()
    steps = trainer.state.global_step
    if not rows or rows[-1]["version"] != steps:
        record(steps, trainer.model)
    wall_s = time.perf_counter() - started
    hit = first_at_target(rows, s["target"])
    summary = {
        "eval_accuracy": rows[-1]["eval_accuracy"],
        "best_eval_accuracy": max(r["eval_accuracy"] for r in rows),
        "steps": steps,
        "target": s["target"],
        "target_reached_at_step": hit["version"] if hit else None,
        "target_reached_at_s": hit["elapsed_s"] if hit else None,
        "wall_s": round(wall_s, 1),
        "stop_reason": stop["reason"] if hit is None else "target reached",
        "curve": [[r["version"], r["eval_accuracy"]] for r in rows],
        "trl": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "entropy_coef_last": trainer.entropy_coef,
        "seed": args.seed,
    }
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    return 0 if hit is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
