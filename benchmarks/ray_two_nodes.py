"""A real two-node Ray cluster on one Linux machine: two network namespaces joined by a veth pair stand in for two
hosts; `tetriinfer serve --launcher ray` on host A places its prefill and decode instances on the two nodes, and
the KV cache crosses the link over our TCP transfer.

    sudo python benchmarks/ray_two_nodes.py --requests 8            # human-readable summary
    sudo python benchmarks/ray_two_nodes.py --json                  # one JSON line (tests read it)

Needs root (``ip netns``), iproute2 and Ray. Steps: make namespaces A and B (addresses --addr, a /24 on the veth),
``ray start --head`` in A and ``ray start --address A:6379`` in B (one CPU each, so Ray must put one instance on
each), ``tetriinfer serve --launcher ray --ray-address A:6379`` in A, a client in A sends --requests completions
with exact lengths, reads /cluster, then everything started in the namespaces is killed and they are deleted
(also on failure). Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT = r"""
import json, sys, time, httpx
base, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + float(sys.argv[4])
while True:
    try:
        if httpx.get(f"{base}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        print(json.dumps({"error": "server not healthy in time"})); sys.exit(1)
    time.sleep(0.5)
model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
done = failed = tokens = 0
t0 = time.perf_counter()
for i in range(n):
    body = {"model": model, "prompt": "a distributed serving system " * (5 + 7 * i), "max_tokens": max_tokens + i,
            "ignore_eos": True, "temperature": 0.0}
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        if r.status_code == 200:
            done += 1; tokens += r.json()["usage"]["completion_tokens"]
        else:
            failed += 1
    except httpx.HTTPError:
        failed += 1
wall = time.perf_counter() - t0
info = httpx.get(f"{base}/cluster", timeout=10).json()
print(json.dumps({"completed": done, "failed": failed, "completion_tokens": tokens,
                  "expected_tokens": sum(max_tokens + i for i in range(n)), "wall_s": wall,
                  "instances": [{k: x.get(k) for k in ("id", "role", "node", "address", "pid", "state")}
                                for x in info["instances"]],
                  "kv_transfers": info["transfers"]["count"], "kv_bytes": info["transfers"]["bytes"]}))
"""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


def make_hosts(ns: tuple[str, str], addr: tuple[str, str]) -> None:
    drop_hosts(ns)
    veth = (f"{ns[0][:10]}-v", f"{ns[1][:10]}-v")
    for n in ns:
        sh("ip", "netns", "add", n)
        sh("ip", "-n", n, "link", "set", "lo", "up")
    sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
    for n, dev, a in zip(ns, veth, addr, strict=True):
        sh("ip", "link", "set", dev, "netns", n)
        sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", dev)
        sh("ip", "-n", n, "link", "set", dev, "up")


def drop_hosts(ns: tuple[str, str]) -> None:
    """Kill everything running in the namespaces (Ray, the server, instances), then delete them."""
    for n in ns:
        pids = sh("ip", "netns", "pids", n, check=False).stdout.split()
        for pid in pids:
            sh("kill", "-9", pid, check=False)
        for _ in range(50):
            if not sh("ip", "netns", "pids", n, check=False).stdout.split():
                break
            time.sleep(0.1)
        sh("ip", "netns", "del", n, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model, made if missing)")
    ap.add_argument("--ns", nargs=2, default=["tiray-a", "tiray-b"], metavar=("A", "B"))
    ap.add_argument("--addr", nargs=2, default=["10.231.7.1", "10.231.7.2"], metavar=("ADDR_A", "ADDR_B"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a summary")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("needs root and iproute2 (ip netns)", file=sys.stderr)
        return 2
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    if not Path(ray_bin).exists():
        print("needs Ray: pip install 'tetriinfer[ray]'", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from tetriinfer.engine.make_model import default_model_path

        model = str(default_model_path())
    ns, addr = tuple(args.ns), tuple(args.addr)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tetri-ray2-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    # Ray 2.60 turns token authentication on: every node and the driver must hold the cluster's token
    token_file = work / "ray_auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    head = f"{addr[0]}:6379"
    ray_tmp = tempfile.mkdtemp(prefix="tiray-", dir="/tmp")  # short: Ray's AF_UNIX socket paths live under it
    logs = {name: open(work / f"{name}.log", "w") for name in ("ray-head", "ray-worker", "serve")}  # noqa: SIM115
    serve = None
    try:
        make_hosts(ns, addr)
        for name, cmd in (
            ("ray-head", in_ns(ns[0], ray_bin, "start", "--head", "--node-ip-address", addr[0], "--port", "6379",
                               "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard=false",
                               "--temp-dir", ray_tmp, "--disable-usage-stats")),
            ("ray-worker", in_ns(ns[1], ray_bin, "start", "--address", head, "--node-ip-address", addr[1],
                                 "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats")),
        ):
            done = subprocess.run(cmd, env=env, stdout=logs[name], stderr=subprocess.STDOUT, timeout=180)
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed (log: {work / (name + '.log')}):\n"
                                   f"{(work / (name + '.log')).read_text()[-2000:]}")
        port = 8000
        serve = subprocess.Popen(
            in_ns(ns[0], sys.executable, "-m", "tetriinfer.cli", "serve", "--model", model, "--port", str(port),
                  "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1", "--kv-backend",
                  "tcp", "--kv-cache-memory-gb", "0.25", "--launcher", "ray", "--ray-address", head,
                  "--startup-timeout", str(args.startup_timeout)),
            env=env, stdout=logs["serve"], stderr=subprocess.STDOUT)
        client = subprocess.run(
            in_ns(ns[0], sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(args.requests),
                  str(args.max_tokens), str(args.startup_timeout)),
            env=env, capture_output=True, text=True, timeout=args.startup_timeout + 600)
        line = (client.stdout.strip().splitlines() or ["{}"])[-1]
        result = json.loads(line)
        if client.returncode != 0 or "error" in result:
            raise RuntimeError(f"client failed: {client.stderr[-2000:]} {line}\nserve log:\n"
                               f"{(work / 'serve.log').read_text()[-3000:]}")
    finally:
        if serve is not None and serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
        drop_hosts(ns)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for f in logs.values():
            f.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"two hosts: {ns[0]} ({addr[0]}, Ray head + front end) and {ns[1]} ({addr[1]}, Ray worker)")
        for i in result["instances"]:
            print(f"  {i['id']:<10} {i['role']:<8} node={i['node']} address={i['address']}")
        print(f"{result['completed']} of {args.requests} requests completed ({result['failed']} failed), "
              f"{result['completion_tokens']} / {result['expected_tokens']} tokens, {result['kv_transfers']} KV "
              f"transfers ({result['kv_bytes'] / 2**20:.1f} MiB across the link), {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
