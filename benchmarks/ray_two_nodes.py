"""A real multi-node Ray cluster on one Linux machine: network namespaces joined by a bridge stand in for hosts;
`tetriinfer serve --launcher ray` on host A places its prefill and decode instances on two nodes, and the KV
cache crosses the link over our TCP transfer. With ``--scale-out``, a third host joins the Ray cluster while the
server runs, a decode instance is added (Ray can only put it on the new host), the original decode instance is
removed (drained) with requests in flight, and serving goes on from the new host.

    sudo python benchmarks/ray_two_nodes.py --requests 8                # two hosts, human-readable summary
    sudo python benchmarks/ray_two_nodes.py --scale-out                 # + the third host and the moves
    sudo python benchmarks/ray_two_nodes.py --scale-out --json          # one JSON line (tests read it)

Needs root (``ip netns``), iproute2 and Ray. Hosts are namespaces tiray-a/b/c (10.231.7.1/2/3 on bridge
tiray-br); ``ray start --head`` in A and ``ray start --address A:6379`` in the others, one CPU each (so Ray must
put one instance on each node); ``tetriinfer serve --launcher ray --ray-address A:6379`` and the client run in A.
Everything started in the namespaces is killed and they are deleted at the end (also on failure). Nothing leaves
the machine.
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
HOSTS = ("tiray-a", "tiray-b", "tiray-c")
ADDRS = ("10.231.7.1", "10.231.7.2", "10.231.7.3")
BRIDGE = "tiray-br"

CLIENT = r"""
import json, sys, time, httpx
from concurrent.futures import ThreadPoolExecutor
base, phase, n, max_tokens, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + timeout
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

def one(i):
    body = {"model": model, "prompt": "a distributed serving system " * (5 + 7 * (i % 6)),
            "max_tokens": max_tokens + i % 6, "ignore_eos": True, "temperature": 0.0}
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        return (r.json()["usage"]["completion_tokens"] if r.status_code == 200 else -1), max_tokens + i % 6
    except httpx.HTTPError:
        return -1, max_tokens + i % 6

out = {"phase": phase}
t0 = time.perf_counter()
with ThreadPoolExecutor(max_workers=4) as pool:
    if phase == "serve":
        results = list(pool.map(one, range(n)))
    else:  # scale-out: add a decode instance (lands on the new host), serve, remove decode-0 mid-flight, serve
        added = httpx.post(f"{base}/cluster/instances", json={"role": "decode"}, timeout=timeout)
        out["add"] = {"status": added.status_code, **(added.json() if added.status_code == 200 else {"text": added.text})}
        results = list(pool.map(one, range(n)))
        inflight = [pool.submit(one, i) for i in range(n)]
        time.sleep(0.3)
        removed = httpx.delete(f"{base}/cluster/instances/decode-0", timeout=timeout)
        out["remove"] = {"status": removed.status_code,
                         **(removed.json() if removed.status_code == 200 else {"text": removed.text})}
        results += [f.result() for f in inflight]
        results += list(pool.map(one, range(n)))
wall = time.perf_counter() - t0
info = httpx.get(f"{base}/cluster", timeout=10).json()
out.update({"completed": sum(got == want for got, want in results), "failed": sum(got != want for got, want in results),
            "completion_tokens": sum(max(got, 0) for got, _ in results), "expected_tokens": sum(w for _, w in results),
            "wall_s": wall, "kv_transfers": info["transfers"]["count"], "kv_bytes": info["transfers"]["bytes"],
            "instances": [{k: x.get(k) for k in ("id", "role", "node", "address", "pid", "state", "steps")}
                          for x in info["instances"]],
            "scaling": info.get("scaling", [])})
print(json.dumps(out))
"""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


def add_host(ns: str, addr: str) -> None:
    """A namespace with loopback up and one veth on the bridge, ``addr``/24."""
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    inside, outside = f"{ns[-1]}-eth", f"{ns}-v"
    sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
    sh("ip", "link", "set", inside, "netns", ns)
    sh("ip", "link", "set", outside, "master", BRIDGE)
    sh("ip", "link", "set", outside, "up")
    sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
    sh("ip", "-n", ns, "link", "set", inside, "up")


def drop_hosts() -> None:
    """Kill everything running in the namespaces (Ray, the server, instances), then delete them and the bridge."""
    for ns in HOSTS:
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            sh("kill", "-9", pid, check=False)
        for _ in range(50):
            if not sh("ip", "netns", "pids", ns, check=False).stdout.split():
                break
            time.sleep(0.1)
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", f"{ns}-v", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def run_client(phase: str, port: int, args: argparse.Namespace, env: dict[str, str], work: Path) -> dict:
    done = subprocess.run(
        in_ns(HOSTS[0], sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", phase, str(args.requests),
              str(args.max_tokens), str(args.startup_timeout)),
        env=env, capture_output=True, text=True, timeout=args.startup_timeout + 900)
    line = (done.stdout.strip().splitlines() or ["{}"])[-1]
    result = json.loads(line)
    if done.returncode != 0 or "error" in result:
        raise RuntimeError(f"client ({phase}) failed: {done.stderr[-2000:]} {line}\nserve log:\n"
                           f"{(work / 'serve.log').read_text()[-3000:]}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model, made if missing)")
    ap.add_argument("--requests", type=int, default=8, help="requests per serving phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--scale-out", action="store_true",
                    help="then add a third host, move the decode instance onto it while serving")
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
        from tetriinfer.engine.make_model import tiny_model_path

        model = str(tiny_model_path())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tetri-ray-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    # Ray 2.60 turns token authentication on: every node and the driver must hold the cluster's token
    token_file = work / "ray_auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    head = f"{ADDRS[0]}:6379"
    ray_tmp = tempfile.mkdtemp(prefix="tiray-", dir="/tmp")  # short: Ray's AF_UNIX socket paths live under it
    logs = {name: open(work / f"{name}.log", "w")  # noqa: SIM115
            for name in ("ray-tiray-a", "ray-tiray-b", "ray-tiray-c", "serve")}
    serve = None
    results: list[dict] = []

    def ray_node(i: int) -> None:
        ns = HOSTS[i]
        cmd = [ray_bin, "start", "--node-ip-address", ADDRS[i], "--num-cpus", "1", "--num-gpus", "0",
               "--disable-usage-stats"]
        cmd += (["--head", "--port", "6379", "--include-dashboard=false", "--temp-dir", ray_tmp] if i == 0
                else ["--address", head])
        done = subprocess.run(in_ns(ns, *cmd), env=env, stdout=logs[f"ray-{ns}"], stderr=subprocess.STDOUT,
                              timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start in {ns} failed:\n{(work / f'ray-{ns}.log').read_text()[-2000:]}")

    try:
        drop_hosts()
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        for i in range(2):
            add_host(HOSTS[i], ADDRS[i])
            ray_node(i)
        port = 8000
        serve = subprocess.Popen(
            in_ns(HOSTS[0], sys.executable, "-m", "tetriinfer.cli", "serve", "--model", model, "--port", str(port),
                  "--mode", "tetriinfer", "--pd-controller", "static", "--prefill-instances", "1",
                  "--decode-instances", "1", "--kv-backend",
                  "tcp", "--kv-cache-memory-gb", "0.25", "--launcher", "ray", "--ray-address", head,
                  "--startup-timeout", str(args.startup_timeout)),
            env=env, stdout=logs["serve"], stderr=subprocess.STDOUT)
        results.append(run_client("serve", port, args, env, work))
        if args.scale_out:
            add_host(HOSTS[2], ADDRS[2])
            ray_node(2)
            results.append(run_client("scale-out", port, args, env, work))
    finally:
        if serve is not None and serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
        drop_hosts()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for f in logs.values():
            f.close()
    if args.json:
        print(json.dumps({"phases": results}))
        return 0
    for r in results:
        print(f"phase {r['phase']}:")
        for e in r.get("scaling", []):
            extra = f"startup {e['startup_s']:.2f} s" if "startup_s" in e else f"drain {e.get('drain_s') or 0:.2f} s"
            print(f"  scaling: {e['action']} {e['instance']} ({e['role']}) on node {e['node'][:8]}, {extra}")
        for i in r["instances"]:
            print(f"  {i['id']:<10} {i['role']:<8} node={i['node'][:8]} address={i['address']} steps={i['steps']}")
        print(f"  {r['completed']} requests completed with their exact lengths, {r['failed']} not; "
              f"{r['completion_tokens']} / {r['expected_tokens']} tokens; {r['kv_transfers']} KV transfers so far "
              f"({r['kv_bytes'] / 2**20:.1f} MiB across hosts); {r['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
