"""Kill the server with SIGKILL while clients post, restart it on the same sqlite file, drain it: every group
that was answered 200 is served exactly once, and nothing that was refused or never sent is."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx

from tests.conftest import ServerProcess, registration_body

REGISTRATION = registration_body(4, num_steps=10_000)


def _group(tag: int, n: int, env_id: int | None) -> dict:
    # Every sequence carries its group's tag as its first token, so served groups can be identified.
    return {
        "tokens": [[tag, i, 3] for i in range(n)],
        "masks": [[-100, i, 3] for i in range(n)],
        "scores": [0.5] * n,
        "inference_logprobs": [[1.0, -0.5, -0.25]] * n,
        "env_id": env_id,
    }


def test_sigkill_mid_stream_loses_no_acknowledged_group(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    server = server_factory("--storage", url).start()
    with httpx.Client(base_url=server.url, timeout=10) as c:
        c.post("/register", json=REGISTRATION)
        c.get("/batch")
        env_id = c.post(
            "/register-env", json={"max_token_length": 64, "desired_name": "half", "weight": 1.0, "group_size": 4}
        ).json()["env_id"]

    acked: dict[int, int] = {}  # tag -> sequences
    in_flight: set[int] = set()
    lock = threading.Lock()
    enough = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=5) as c:
            for k in range(10_000):
                tag = 1000 + worker * 100_000 + k
                half = k % 3 == 0  # some groups are halves, held until a partner arrives
                body = _group(tag, 2 if half else 4, env_id if half else None)
                with lock:
                    in_flight.add(tag)
                try:
                    answer = c.post("/scored_data", json=body)
                except httpx.TransportError:
                    return  # the server is gone; this request may or may not have been stored
                with lock:
                    in_flight.discard(tag)
                    if answer.status_code == 200:
                        acked[tag] = 2 if half else 4
                        if len(acked) >= 120:
                            enough.set()

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    assert enough.wait(60), "clients did not get 120 answers within 60 s"
    server.kill()
    for t in threads:
        t.join(30)

    restarted = server_factory("--storage", url).start()
    served: Counter[int] = Counter()
    with httpx.Client(base_url=restarted.url, timeout=10) as c:
        assert c.get("/info").json()["batch_size"] == 4, "registration must survive the crash"
        while (batch := c.get("/batch").json()["batch"]) is not None:
            assert sum(len(item["tokens"]) for item in batch) == 4
            for item in batch:
                for row in item["tokens"]:
                    served[row[0]] += 1
        held = c.get("/status").json()["held_sequences"]

    duplicates = {tag: n for tag, n in served.items() if n > (acked.get(tag) or 4)}
    assert not duplicates, f"served more sequences than were sent: {duplicates}"
    strangers = set(served) - set(acked) - in_flight
    assert not strangers, f"served groups that were never acknowledged nor in flight: {sorted(strangers)[:5]}"
    missing = {tag: n for tag, n in acked.items() if served.get(tag, 0) != n}
    # Only halves still waiting for a partner may be missing from the drained batches, and they are still held.
    assert all(n == 2 for n in missing.values()), missing
    assert sum(missing.values()) <= held
