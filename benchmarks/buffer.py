"""Buffer server benchmark: rollhub against the published atroposlib 0.4.0 server, same load, same machine.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/buffer.py``). Each server runs as its own process on
127.0.0.1; the load is groups of ``--group-size`` sequences x ``--seq-len`` tokens with inference log-probs,
posted over ``--clients`` keep-alive connections by a minimal HTTP/1.1 load generator with pre-built requests
(so the figures measure the servers, not the clients). Printed: ingest groups/s, GET /batch latency for one batch
of ``--batch-size`` sequences, server memory per buffered token, and the ratios against atroposlib. Loopback
only; every server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from rollhub.run.child_server import ChildServer
from rollhub.wire.codec import MEDIA_TYPE, pack_group
from rollhub.wire.group import group_from_json

# make setup installs the published atroposlib here (not into the venv, where its run-api script would replace
# rollhub's); its server process finds it through PYTHONPATH.
REFERENCE_DIR = Path(sys.prefix) / "reference"


def reference_env() -> dict[str, str]:
    """Environment variables for the atroposlib server process: PYTHONPATH with the reference directory added."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([*paths, str(REFERENCE_DIR)])} if REFERENCE_DIR.is_dir() else {}


@dataclass
class Target:
    name: str
    cmd: list[str]
    binary: bool = False
    env: dict[str, str] | None = None


def make_group(rng: np.random.Generator, group_size: int, seq_len: int, prompt: int) -> dict:
    tokens = rng.integers(0, 50_000, size=(group_size, seq_len))
    masks = tokens.copy()
    masks[:, :prompt] = -100
    logprobs = (-rng.exponential(1.0, size=(group_size, seq_len))).astype(np.float32).astype(np.float64)
    logprobs[:, :prompt] = 1.0
    return {
        "tokens": tokens.tolist(),
        "masks": masks.tolist(),
        "scores": rng.choice([0.0, 1.0], size=group_size).tolist(),
        "inference_logprobs": logprobs.tolist(),
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def register(c: httpx.Client, batch_size: int) -> None:
    c.post(
        "/register",
        json={
            "wandb_group": "bench",
            "wandb_project": "bench",
            "batch_size": batch_size,
            "max_token_len": 4096,
            "checkpoint_dir": "",
            "save_checkpoint_interval": 0,
            "starting_step": 0,
            "num_steps": 10**6,
        },
    ).raise_for_status()


def _read_response(sock: socket.socket, pending: bytes) -> tuple[int, bytes]:
    """Read one HTTP/1.1 response (Content-Length framed); return (status, bytes left over)."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        pending += chunk
    head, _, rest = pending.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.strip().lower() == b"content-length"
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return status, rest[length:]


def post_all(url: str, bodies: list[bytes], binary: bool, clients: int) -> float:
    """Post every body over ``clients`` keep-alive connections with a minimal HTTP/1.1 client.

    The requests are pre-built bytes written with one ``sendall``: the load generator costs microseconds per
    request, so the figures are the server's even when it answers in a millisecond.
    """
    host, port = url.removeprefix("http://").split(":")
    ctype = MEDIA_TYPE if binary else "application/json"
    requests = [
        (
            f"POST /scored_data HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\nContent-Length: {len(b)}\r\n\r\n"
        ).encode()
        + b
        for b in bodies
    ]
    errors: list[str] = []

    def worker(k: int) -> None:
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending = b""
            for request in requests[k::clients]:
                sock.sendall(request)
                status, pending = _read_response(sock, pending)
                if status != 200:
                    errors.append(f"status {status}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return wall


def bench(target: Target, args: argparse.Namespace, json_bodies: list[bytes], bin_bodies: list[bytes]) -> dict:
    bodies = bin_bodies if target.binary else json_bodies
    server = ChildServer(target.cmd, env=target.env, name=target.name).start()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            register(c, args.batch_size)
            c.get("/batch")
            base = rss_bytes(server.proc.pid)
            wall = post_all(server.url, bodies, target.binary, args.clients)
            grown = rss_bytes(server.proc.pid) - base
            tokens = len(bodies) * args.group_size * args.seq_len
            c.get("/reset_data")
            register(c, args.batch_size)
            per_batch = args.batch_size // args.group_size
            latencies = []
            accept = {"Accept": MEDIA_TYPE} if target.binary else {}
            for r in range(args.repeats):
                post_all(server.url, bodies[r * per_batch : (r + 1) * per_batch], target.binary, args.clients)
                start = time.perf_counter()
                answer = c.get("/batch", headers=accept)
                _ = answer.content
                latencies.append(time.perf_counter() - start)
                assert answer.status_code == 200 and len(answer.content) > 1000, answer.text[:200]
    finally:
        server.stop()
    return {
        "ingest_groups_per_s": len(bodies) / wall,
        "batch_latency_s": statistics.median(latencies),
        "bytes_per_token": max(grown, 0) / tokens,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--groups", type=int, default=160)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    distinct = [make_group(rng, args.group_size, args.seq_len, 256) for _ in range(8)]
    json_bodies = [orjson.dumps(distinct[i % 8]) for i in range(args.groups)]
    bin_bodies = [pack_group(group_from_json(distinct[i % 8])) for i in range(args.groups)]
    py = sys.executable
    tmp = tempfile.mkdtemp(prefix="rollhub-bench-")
    env_serve = [py, "-m", "rollhub", "serve", "--host", "127.0.0.1", "--port", "{port}", "--log-level", "error"]
    targets = [
        Target(
            "atroposlib 0.4.0 (JSON)",
            [py, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", "{port}"],
            env=reference_env(),
        ),
        Target("rollhub memory (JSON)", [*env_serve, "--storage", "memory"]),
        Target("rollhub memory (msgpack)", [*env_serve, "--storage", "memory"], binary=True),
        Target("rollhub sqlite (JSON)", [*env_serve, "--storage", f"sqlite:///{tmp}/a.db"]),
        Target("rollhub sqlite (msgpack)", [*env_serve, "--storage", f"sqlite:///{tmp}/b.db"], binary=True),
    ]
    results = {}
    for target in targets:
        print(f"running {target.name} ...", file=sys.stderr, flush=True)
        results[target.name] = bench(target, args, json_bodies, bin_bodies)
    ref = results[targets[0].name]
    print(
        f"\nload: {args.groups} groups of {args.group_size} x {args.seq_len} tokens with log-probs, "
        f"{args.clients} clients; GET /batch of {args.batch_size} sequences (median of {args.repeats}); "
        f"{os.cpu_count()} cores\n"
    )
    print("| server | ingest groups/s | x ref | GET /batch s | x faster | bytes/token |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['ingest_groups_per_s']:.1f} | {r['ingest_groups_per_s'] / ref['ingest_groups_per_s']:.1f} "
            f"| {r['batch_latency_s']:.4f} | {ref['batch_latency_s'] / r['batch_latency_s']:.1f} "
            f"| {r['bytes_per_token']:.1f} |"
        )
    mem_json = results["rollhub memory (JSON)"]["ingest_groups_per_s"]
    sql_json = results["rollhub sqlite (JSON)"]["ingest_groups_per_s"]
    mem_bin = results["rollhub memory (msgpack)"]["ingest_groups_per_s"]
    sql_bin = results["rollhub sqlite (msgpack)"]["ingest_groups_per_s"]
    print(f"\nsqlite / memory ingest: JSON {sql_json / mem_json:.2f}, msgpack {sql_bin / mem_bin:.2f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
