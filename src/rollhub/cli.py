"""The ``rollhub`` command: ``serve`` (alias ``run-api``), ``run``, ``gateway`` and ``demo``."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from rollhub.observe.logs import add_log_level, configure_logging
from rollhub.server.settings import DEFAULT_STORAGE, ServerSettings

log = logging.getLogger("rollhub")
# Every demo with its one-line description; the first is what ``rollhub demo`` runs with no name.
DEMOS: dict[str, str] = {
    "cartpole": "PPO learns CartPole-v1 on a local rollout fleet to a mean return >= 475",
    "buffer": "the buffer server on sqlite, rollout handlers and a trainer over HTTP",
    "arithmetic": "a tiny transformer learns addition by GRPO via rollhub serve and a Ray fleet",
    "llm": "a Hugging Face model (tiny Qwen2, built locally) learns addition by GRPO, sampled through vLLM",
    "tools": "a tiny Qwen2 learns to call a calculator tool, then answer: multi-turn episodes through vLLM",
}
DEFAULT_DEMO = next(iter(DEMOS))
MAIN_HELP = f"""usage: rollhub COMMAND [options]

rollhub: an AtroposLib-compatible trajectory buffer server, rollout and trainer clients, a Ray rollout fleet.

commands:
  serve      run the buffer server (sqlite:///rollhub.db by default; --storage memory keeps it in memory)
  run-api    the same as serve, under atroposlib's command name and flags
  run        train from a TOML config (rollhub run CONFIG.toml [--set key=value], --print-config, --resume DIR)
  gateway    OpenAI-compatible sessions in front of running engines; finished groups go to a buffer server
  demo       run a demo: {", ".join(DEMOS)} (default {DEFAULT_DEMO})

Run 'rollhub COMMAND --help' for a command's options, e.g. 'rollhub serve --help', 'rollhub demo --help'."""


def _serve_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the rollhub buffer server (AtroposLib API compatible).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--storage", default=None, help=f"storage URL: memory or sqlite:///path.db (default {DEFAULT_STORAGE})"
    )
    p.add_argument("--max-staleness", type=int, default=None, help="never serve items older than this many steps")
    p.add_argument("--max-queued-sequences", type=int, default=None, help="bound the queue; past it answer 429")
    p.add_argument("--retry-after", type=float, default=None, help="seconds suggested to producers refused with 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set ROLLHUB_API_KEY)")
    p.add_argument("--no-reset", action="store_true", help="switch off GET /reset_data")
    p.add_argument("--max-body-mb", type=float, default=None, help="largest accepted request body in MiB")
    p.add_argument(
        "--max-request-memory-mb",
        type=float,
        default=None,
        help="most MiB all request bodies in flight may hold at once; past it answer 503 (default 512)",
    )
    p.add_argument(
        "--body-idle-timeout", type=float, default=None, help="seconds a body may stall between chunks (408 past it)"
    )
    p.add_argument("--body-timeout", type=float, default=None, help="seconds a whole body may take (408 past it)")
    p.add_argument(
        "--no-check-advantage-lengths",
        action="store_true",
        help="accept advantage rows of another length than their token rows (0.4.0 accepts them)",
    )
    p.add_argument(
        "--stamp-unversioned",
        action="store_true",
        help="give a group sent without policy_version (an Atropos environment's) the trainer's latest published "
        "version on arrival, so --max-staleness applies to it",
    )
    p.add_argument("--reload", action="store_true", help="restart on code changes (development)")
    add_log_level(p, "the server")
    return p


def _settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings.from_env(
        storage=args.storage,
        max_staleness=args.max_staleness,
        max_queued_sequences=args.max_queued_sequences,
        retry_after_s=args.retry_after,
        api_key=args.api_key,
        allow_reset=False if args.no_reset else None,
        max_body_bytes=None if args.max_body_mb is None else int(args.max_body_mb * 1024 * 1024),
        check_advantage_lengths=False if args.no_check_advantage_lengths else None,
        max_request_memory_bytes=None
        if args.max_request_memory_mb is None
        else int(args.max_request_memory_mb * 1024 * 1024),
        body_idle_timeout_s=args.body_idle_timeout,
        body_timeout_s=args.body_timeout,
        stamp_unversioned=True if args.stamp_unversioned else None,
    )


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(argv: list[str] | None = None, prog: str = "rollhub serve") -> int:
    """Run the server until interrupted."""
    import uvicorn

    from rollhub.errors import RollhubError
    from rollhub.server import create_app

    args = _serve_parser(prog).parse_args(argv)
    configure_logging(args.log_level)
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"{prog}: invalid setting: {exc}", file=sys.stderr)
        return 2
    if not settings.api_key and not _is_loopback(args.host):
        log.warning(
            "binding %s with no API key: anyone who can reach this port can read and reset the buffer; "
            "pass --api-key or set ROLLHUB_API_KEY",
            args.host,
        )
    log.info("rollhub serving on http://%s:%d with storage %s", args.host, args.port, settings.storage)
    if args.reload:
        for name, value in settings.model_dump().items():
            if value is not None:
                os.environ[f"ROLLHUB_{name.upper()}"] = str(value)
        uvicorn.run("rollhub.server:app", host=args.host, port=args.port, reload=True, log_level=args.log_level)
        return 0
    try:
        app = create_app(settings)
    except RollhubError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def demo_help() -> str:
    """The text of ``rollhub demo --help``: every demo with one line, and which one runs by default."""
    width = max(len(name) for name in DEMOS)
    lines = [
        "usage: rollhub demo [NAME] [options]",
        "",
        f"Run one of the demos; with no NAME, {DEFAULT_DEMO} runs.",
        "",
        "demos:",
        *(f"  {name:<{width}}  {'(default) ' if name == DEFAULT_DEMO else ''}{text}" for name, text in DEMOS.items()),
        "",
        "Run 'rollhub demo NAME --help' for a demo's options. 'rollhub demo NAME --write-config my.toml' copies a",
        "demo's config (all but buffer have one) to edit and run with 'rollhub run my.toml'.",
    ]
    return "\n".join(lines)


def demo(argv: list[str]) -> int:
    """Run the demo named by ``argv[0]`` with the rest as its options (default: cartpole, ``DEFAULT_DEMO``).

    ``rollhub demo --help`` lists the demos; ``rollhub demo NAME --help`` shows one demo's options.
    """
    if argv and argv[0] in ("-h", "--help"):
        print(demo_help())
        return 0
    named = bool(argv) and not argv[0].startswith("-")
    name, rest = (argv[0], argv[1:]) if named else (DEFAULT_DEMO, argv)
    if name not in DEMOS:
        print(f"rollhub demo: unknown demo {name!r}; choose one of {', '.join(DEMOS)}", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(f"rollhub.demos.{name}").main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollhub`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(MAIN_HELP)
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("serve", "run-api"):
        return serve(rest, prog=f"rollhub {command}")
    if command == "run":
        from rollhub.run.main import main as run_main

        return run_main(rest)
    if command == "gateway":
        from rollhub.run.gateway import main as gateway_main

        return gateway_main(rest)
    if command == "demo":
        return demo(rest)
    print(
        f"rollhub: unknown command {command!r}; choose one of serve, run-api, run, gateway, demo (rollhub --help)",
        file=sys.stderr,
    )
    return 2


def run_api_main() -> int:
    """The ``run-api`` console script (atroposlib's name and flags)."""
    return serve(sys.argv[1:], prog="run-api")


if __name__ == "__main__":
    raise SystemExit(main())
