#!/usr/bin/env python3
"""What the SSH forward (rigctl/forward.py) adds to a request, measured side by side on one server: the lab
desktop's ``smollm2`` listens on every address, so it is asked both directly at the rig's bridge address and
through a forward of the rig's SSH connection to its 127.0.0.1, alternating, the order swapped every repeat.

Printed: the median ``GET /health`` round trip and the median wall time of a streamed 16-token greedy chat
(TTFT and decode on the client's clock) each way, and forwarded / direct as ratios. Aim: a chat's wall time
within 1.05x (what a load curve or a sweep measures from the controller); a bare round trip costs the forward's
channel open (one SSH round trip per new connection; the HTTP client keeps its connection, so only the first).
Needs the lab provisioned (`rigctl lab up && rigctl provision`).

    RIGCTL_LAB_SLOT=N .venv/bin/python perf/forward_overhead.py [--repeats 5] [--health 50] [--host desktop]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rigctl.connections import connections
from rigctl.forward import Forward, server_endpoint
from rigctl.inventory import Inventory
from rigctl.llama_http import Endpoint, ServerClient
from rigctl.ssh import session

REPO = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "Count from one to twenty in words."}]


def measure(endpoint: Endpoint, health: int) -> tuple[float, float]:
    """(median /health round trip s, wall time s of a streamed 16-token greedy chat) on one kept connection."""
    with ServerClient(endpoint) as client:
        client.health()  # the connection (and through a forward, its channel) opened outside the timing
        trips = []
        for _ in range(health):
            began = time.perf_counter()
            assert client.health().ok
            trips.append(time.perf_counter() - began)
        began = time.perf_counter()
        reply = client.chat_stream(MESSAGES, max_tokens=16, temperature=0.0, extra={"cache_prompt": False})
        wall = time.perf_counter() - began
        assert reply.content
    return statistics.median(trips), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--health", type=int, default=50, help="/health round trips per repeat and way")
    parser.add_argument("--host", default="desktop")
    args = parser.parse_args()
    host = Inventory.load(REPO / "inventory" / "lab").host(args.host)
    server = host.server("smollm2")
    direct = server_endpoint(host, server)
    assert direct.via is None, f"{server.name} binds {server.bind}: not reachable directly"
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "forwarded": []}
    with connections(), session(host) as ssh, Forward(ssh, "127.0.0.1", server.port) as forward:
        forwarded = Endpoint(f"http://127.0.0.1:{server.port}", server.api_key, direct.label, via=forward.url)
        ways = {"direct": direct, "forwarded": forwarded}
        for repeat in range(args.repeats):
            order = ["direct", "forwarded"] if repeat % 2 == 0 else ["forwarded", "direct"]
            for way in order:
                results[way].append(measure(ways[way], args.health))
    trip = {way: statistics.median(r[0] for r in rows) for way, rows in results.items()}
    chat = {way: statistics.median(r[1] for r in rows) for way, rows in results.items()}
    print(f"{host.name}/{server.name}, {args.repeats} repeats, {args.health} /health round trips each")
    print(f"{'':>10} {'direct':>10} {'forwarded':>10} {'ratio':>7}")
    print(f"{'/health':>10} {trip['direct'] * 1e3:>8.2f}ms {trip['forwarded'] * 1e3:>8.2f}ms "
          f"{trip['forwarded'] / trip['direct']:>6.2f}x")
    print(f"{'chat 16':>10} {chat['direct'] * 1e3:>8.1f}ms {chat['forwarded'] * 1e3:>8.1f}ms "
          f"{chat['forwarded'] / chat['direct']:>6.2f}x")
    # On a shared machine the model's own time drifts more than the forward adds: each repeat's pair, as run.
    pairs = ", ".join(f"{d[1]:.2f}/{f[1]:.2f}" for d, f in zip(results["direct"], results["forwarded"], strict=True))
    print(f"chat s per repeat, direct/forwarded: {pairs}")


if __name__ == "__main__":
    main()
