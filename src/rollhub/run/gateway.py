"""``rollhub gateway``: the capture gateway as a service, in front of running engines, sending to a buffer server.

An existing agent, written against the OpenAI client, trains by pointing its ``base_url`` at a session of this
gateway (:mod:`rollhub.gateway.app` lists the routes). The command assembles three parts that already run on
their own:

- **the engines**: one or more OpenAI-compatible servers (``vllm serve`` of the model being trained), each a
  :class:`~rollhub.inference.openai_client.OpenAICompletionsClient`; a session is pinned to the least busy one;
- **the chat template**: the served model's tokenizer (a model directory or tokenizer path), which renders the
  conversation the agent sends onto the exact token ids recorded so far;
- **the sink**: the buffer server (``rollhub serve``, or an Atropos-compatible one) that receives each finished
  group through an :class:`~rollhub.rollout.writers.http_writer.HttpWriter`, registered like any environment. A full
  queue (``429``) is waited out, as the server's ``Retry-After`` asks, for up to ``--send-timeout`` seconds; past
  that the ``finish`` call that completed the group answers ``503`` and the group is counted as failed.

**Policy versions.** Every recorded turn carries the version of the weights the gateway believes the engines hold.
By default the gateway polls the buffer's ``GET /status`` every ``--version-poll`` seconds and takes the trainer's
published version: a trainer that pushes weights into the engines and then publishes the version makes the stamp
at most one poll late, so a turn is never stamped newer than the weights that sampled it. ``--version-poll 0``
leaves versions to ``POST /policy-version`` (a trainer that tells the gateway itself).

Sampling is the gateway's, whatever an agent asks (the ``--temperature``, ``--top-p``, ``--top-k`` and
``--min-p`` flags): the trainer must know the distribution every token was drawn from.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollhub.errors import QueueFull, RollhubError
from rollhub.experience import Group
from rollhub.observe.logs import add_log_level, configure_logging

log = logging.getLogger("rollhub.gateway")


def parser(prog: str = "rollhub gateway") -> argparse.ArgumentParser:
    """The command's options."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve OpenAI-compatible sessions in front of running engines; each finished group of sessions "
        "goes to a buffer server as a group of episodes with the exact tokens the engines sampled.",
    )
    p.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="an OpenAI-compatible engine, e.g. http://127.0.0.1:8001 (repeat for several)",
    )
    p.add_argument("--model", required=True, help="the served model name (requests naming another get 404)")
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="the served model's directory or tokenizer (its chat template renders conversations)",
    )
    p.add_argument("--buffer", required=True, metavar="URL", help="the buffer server, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    p.add_argument("--env-name", default="gateway", help="the name registered with the buffer (default gateway)")
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="sessions per group, as registered with the buffer (a session's own group_size rules)",
    )
    p.add_argument("--max-tokens", type=int, default=4096, help="a session's episode token budget (default 4096)")
    p.add_argument(
        "--turn-max-tokens", type=int, default=512, help="a call's max_tokens when the request gives none (default 512)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every turn (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="most likely tokens kept (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (default 0: off)")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=600.0,
        help="seconds a session may send nothing before it is abandoned (default 600)",
    )
    p.add_argument("--discount", type=float, default=1.0, help="per-turn discount of an episode's score (default 1)")
    p.add_argument(
        "--version-poll",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="poll the buffer for the trainer's published version this often (0: only POST "
        "/policy-version sets it; default 2)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a finished group may wait for room in a full buffer (default 300)",
    )
    p.add_argument(
        "--register-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for a trainer to start at the buffer before giving up (default 120)",
    )
    p.add_argument("--engine-api-key", default=None, help="bearer token for the engines")
    add_log_level(p, "the gateway")
    return p


@dataclass
class BufferSink:
    """Delivers finished groups to a buffer server through ``writer``, waiting out a full queue.

    Args:
        writer: the buffer writer (``write(groups)`` raising :class:`QueueFull` with ``accepted``).
        timeout_s: the longest a call may wait for room before it gives up and raises.
        sleep: the pause function (tests pass their own).
        clock: the time source.
    """

    writer: Any
    timeout_s: float = 300.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def __call__(self, groups: list[Group]) -> None:
        """Send ``groups`` in order; each is delivered once.

        Raises:
            QueueFull: the buffer stayed full for ``timeout_s``; the groups not yet accepted were not sent.
            RollhubError: the buffer refused the data or could not be reached.
        """
        deadline = self.clock() + self.timeout_s
        rest = list(groups)
        while rest:
            try:
                self.writer.write(rest)
                return
            except QueueFull as exc:
                rest = rest[exc.accepted :]
                if not rest:
                    return
                left = deadline - self.clock()
                if left <= 0:
                    raise QueueFull(
                        f"the buffer stayed full for {self.timeout_s:g} s (--send-timeout); "
                        f"{len(rest)} group(s) not sent",
                        retry_after_s=exc.retry_after_s,
                    ) from exc
                self.sleep(min(max(exc.retry_after_s, 0.05), left))


class VersionFollower:
    """Keeps ``gateway.policy_version`` at the buffer's published version, polled every ``every_s`` seconds.

    Args:
        gateway: the gateway whose stamp it sets.
        read: returns the published version (``None`` while none is).
        every_s: the pause between polls.
    """

    def __init__(self, gateway: Any, read: Callable[[], int | None], every_s: float) -> None:
        self.gateway, self.read, self.every_s = gateway, read, every_s
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-version", daemon=True)

    def poll(self) -> None:
        """Read the version once and set it when it is newer than the gateway's."""
        version = self.read()
        current = self.gateway.policy_version
        if version is not None and (current is None or version > current):
            self.gateway.policy_version = version

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except RollhubError as exc:  # the buffer restarting: keep the last version, say so once per streak
                self.failures += 1
                if self.failures == 1:
                    log.warning("cannot read the published version from the buffer: %s", exc)
            else:
                self.failures = 0

    def start(self) -> None:
        """Poll in a background thread until :meth:`stop`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def build(args: argparse.Namespace) -> tuple[Any, Any, VersionFollower | None, list[Any]]:
    """The gateway, its writer, its version follower (``None`` with ``--version-poll 0``) and its engine clients."""
    from rollhub.envs.episode.render import ChatRenderer
    from rollhub.gateway import Gateway, GatewayConfig
    from rollhub.inference.base import SamplingParams
    from rollhub.inference.openai_client import OpenAICompletionsClient
    from rollhub.models import load_tokenizer
    from rollhub.rollout.writers.http_writer import HttpWriter

    tokenizer = load_tokenizer(args.tokenizer)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    config = GatewayConfig(
        model=args.model,
        max_tokens=args.max_tokens,
        turn_max_tokens=args.turn_max_tokens,
        sampling=sampling,
        idle_timeout_s=args.idle_timeout,
        discount=args.discount,
        env_name=args.env_name,
    )
    writer = HttpWriter(
        args.buffer, args.env_name, args.group_size, args.max_tokens, register_timeout_s=args.register_timeout
    )
    engines = [
        OpenAICompletionsClient(url, args.model, tokenizer, api_key=args.engine_api_key, send_seed=False)
        for url in args.engine
    ]
    gateway = Gateway(engines, ChatRenderer(tokenizer), config, BufferSink(writer, args.send_timeout))
    follower = None
    if args.version_poll > 0:
        follower = VersionFollower(gateway, lambda: writer.backlog().policy_version, args.version_poll)
    return gateway, writer, follower, engines


def _check(args: argparse.Namespace) -> str | None:
    """The first bad option, said as the message to print, or ``None``."""
    checks = [
        ("--port", 0 < args.port < 65536, "a port between 1 and 65535"),
        ("--group-size", args.group_size >= 1, "at least 1"),
        ("--max-tokens", args.max_tokens >= 1, "at least 1"),
        ("--turn-max-tokens", args.turn_max_tokens >= 1, "at least 1"),
        ("--temperature", args.temperature > 0, "above 0 (greedy turns have no distribution to train on)"),
        ("--top-p", 0 < args.top_p <= 1, "in (0, 1]"),
        ("--top-k", args.top_k >= 0, "0 (off) or more"),
        ("--min-p", 0 <= args.min_p < 1, "in [0, 1)"),
        ("--idle-timeout", args.idle_timeout > 0, "above 0"),
        ("--discount", 0 < args.discount <= 1, "in (0, 1]"),
        ("--version-poll", args.version_poll >= 0, "0 (off) or more"),
        ("--send-timeout", args.send_timeout >= 0, "0 or more"),
    ]
    for flag, ok, rule in checks:
        if not ok:
            return f"{flag} must be {rule}, got {getattr(args, flag[2:].replace('-', '_'))}"
    for url in [*args.engine, args.buffer]:
        if not url.startswith(("http://", "https://")):
            return f"{url!r} is not an http(s) URL; give --engine and --buffer as http://HOST:PORT"
    return None


def main(argv: Sequence[str] | None = None, prog: str = "rollhub gateway") -> int:
    """Run the gateway until interrupted; 2 on a bad option or a part that cannot be built."""
    import uvicorn

    from rollhub.gateway.app import create_gateway_app

    args = parser(prog).parse_args(argv)
    configure_logging(args.log_level)
    problem = _check(args)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    try:
        gateway, writer, follower, engines = build(args)
    except RollhubError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if follower is not None:
        follower.start()
    log.info(
        "rollhub gateway on http://%s:%d: model %s, %d engine(s), groups to %s",
        args.host,
        args.port,
        args.model,
        len(engines),
        args.buffer,
    )
    try:
        uvicorn.run(
            create_gateway_app(gateway), host=args.host, port=args.port, log_level=args.log_level, access_log=False
        )
    finally:
        if follower is not None:
            follower.stop()
        writer.close()
        for engine in engines:
            engine.close()
    return 0
