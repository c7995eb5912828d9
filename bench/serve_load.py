"""The page under load: `memfit serve` on 127.0.0.1 and 20 clients posting plan updates for catalog models.

Each client is one person on the page: a keep-alive connection posting the form's values as the page does
(application/json), the next update as soon as the last one answers (closed loop: the worst a debounced page
sends). The requests are bounded: --requests per client, in two rounds:

- distinct: every update a setup no client asked before (model x GPU x micro-batch x sequence), so nothing
  already computed can answer it;
- shared: the clients explore the same few setups (the page's default model on a few GPUs and micro-batches),
  as people comparing the same popular choices do;
- paced: distinct setups again, each client sending one update per --pace seconds (a person changing a field
  and reading the chart; the page itself waits 250 ms after the last keystroke), starting at random offsets.

For each round it prints p50 / p99 latency, requests/s and the answers' status codes. --src runs the server from
another source tree (e.g. a checkout of an older commit's src/) so one run compares before and after:

    python bench/serve_load.py --src ../old-checkout/src --src src

The budget (issue 22): an update under 100 ms for a catalog model at 20 concurrent users, on 2 cores.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MODELS = ("llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "gemma-2-9b", "phi-3-mini", "llama-3.2-1b", "llama-2-13b",
          "qwen3-8b")
GPUS = ("A100-80GB", "RTX-4090", "H100-80GB", "L4", "A10G", "L40S")
BATCHES = ("1", "2", "4", "8")
SEQS = ("512", "1024", "2048", "4096")
SHARED = [{"model": "llama-3.1-8b", "gpu": gpu, "batch": batch}
          for gpu in ("A100-80GB", "RTX-4090", "H100-80GB") for batch in ("1", "2", "4")]



def start_server(src: str | None) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    env["PYTHONUNBUFFERED"] = "1"
    # `memfit serve` itself, as a user starts it
    proc = subprocess.Popen([sys.executable, "-c", "from memfit.cli import main; main()", "serve", "--port", "0",
                             "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("memfit serve: http://127.0.0.1:"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()[-2000:]}")
    return proc, line.split()[2]


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of the server and of its worker processes so far; None off Linux. On a shared
    machine the latencies depend on what else runs; the CPU an update costs much less."""
    def own(stat_path: Path) -> tuple[int, float]:
        fields = stat_path.read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    if not Path(f"/proc/{pid}/stat").exists():
        return None
    total = own(Path(f"/proc/{pid}/stat"))[1]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent, seconds = own(stat)
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            total += seconds
    return total


def post(conn: http.client.HTTPConnection, values: dict) -> tuple[int, float]:
    body = json.dumps(values).encode()
    start = time.perf_counter()
    conn.request("POST", "/api/plan", body=body, headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    reply.read()
    return reply.status, time.perf_counter() - start


def distinct_setups():
    grid = itertools.product(MODELS, GPUS, BATCHES, SEQS)
    return [{"model": m, "gpu": g, "batch": b, "seq": s} for m, g, b, s in grid]


def run_round(url: str, plans: list[list[dict]], pace: float = 0.0) -> dict:
    """plans[i]: client i's updates, in order. All clients start together; with `pace`, each sends its updates
    `pace` seconds apart (from a random offset in the first period) instead of back to back."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(len(plans) + 1)

    def client(updates: list[dict], offset: float) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        barrier.wait()
        begin = time.perf_counter() + offset
        for k, values in enumerate(updates):
            if pace:
                time.sleep(max(0.0, begin + k * pace - time.perf_counter()))
            status, seconds = post(conn, values)
            with lock:
                latencies.append(seconds)
                statuses[status] = statuses.get(status, 0) + 1
        conn.close()

    offsets = random.Random(0).sample(range(1000), len(plans))
    threads = [threading.Thread(target=client, args=(p, pace * o / 1000)) for p, o in zip(plans, offsets)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "per_s": len(latencies) / wall, "statuses": statuses}


def bench(src: str | None, clients: int, requests: int, pace: float) -> dict[str, dict]:
    proc, url = start_server(src)
    try:
        conn = http.client.HTTPConnection(*url.removeprefix("http://").rstrip("/").rsplit(":", 1), timeout=120)
        post(conn, {"model": "gpt2"})  # warm: imports and the first plan, as a page load does
        conn.close()
        setups = distinct_setups()
        if len(setups) < 2 * clients * requests:
            raise SystemExit(f"--requests: at most {len(setups) // clients // 2} per client")
        distinct = [setups[i:clients * requests:clients] for i in range(clients)]
        paced = [setups[clients * requests + i::clients][:requests] for i in range(clients)]
        shared = [[SHARED[(i + k) % len(SHARED)] for k in range(requests)] for i in range(clients)]
        rounds = {}
        for name, plans, round_pace in (("distinct", distinct, 0.0), ("shared", shared, 0.0),
                                        ("paced", paced, pace)):
            before = cpu_seconds(proc.pid)
            rounds[name] = run_round(url, plans, round_pace)
            after = cpu_seconds(proc.pid)
            rounds[name]["cpu_ms"] = (None if before is None or after is None
                                      else 1000 * (after - before) / rounds[name]["requests"])
        return rounds
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8, help="updates per client and round (default 8)")
    parser.add_argument("--pace", type=float, default=1.0, help="seconds between a paced client's updates")
    parser.add_argument("--src", action="append", help="a source tree to serve from (repeat to compare); "
                        "default: the installed memfit")
    args = parser.parse_args()
    print(f"memfit serve under load: {args.clients} clients x {args.requests} updates per round "
          f"(paced: one per {args.pace:g} s), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| server | round | requests | p50 ms | p99 ms | requests/s | server CPU ms / update | statuses |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for src in args.src or [None]:
        for name, row in bench(src, args.clients, args.requests, args.pace).items():
            statuses = ", ".join(f"{code}: {n}" for code, n in sorted(row["statuses"].items()))
            cpu = "n/a" if row["cpu_ms"] is None else f"{row['cpu_ms']:.1f}"
            print(f"| {src or 'installed'} | {name} | {row['requests']} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} "
                  f"| {row['per_s']:.1f} | {cpu} | {statuses} |", flush=True)


if __name__ == "__main__":
    main()
