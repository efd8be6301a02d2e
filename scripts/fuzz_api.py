"""Fuzz the OpenAI-compatible API with schemathesis from the server's own OpenAPI schema (seeded, bounded).

Serves the tiny model in-process (``--mode single``-like: one engine on a thread) on 127.0.0.1, sends ``--cases``
generated requests (half schema-valid, half schema-violating; more to the two generation routes), and prints the
count per operation and status. Exit status 1 if any request got a 5xx or the server is not healthy afterwards.

    python scripts/fuzz_api.py --cases 1000 --seed 1234
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz_helpers import fuzz  # noqa: E402
from tests.test_server_api import ENGINE_KW, ServerThread  # noqa: E402
from tetriinfer.engine.engine_config import EngineConfig  # noqa: E402
from tetriinfer.engine.make_model import make_model  # noqa: E402
from tetriinfer.runtime.inprocess import InProcessEngineClient  # noqa: E402
from tetriinfer.server.app import build_app  # noqa: E402
from tetriinfer.server.limits import ServerLimits  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("llama", "tiny", Path(tmp) / "tiny-llama", seed=0)
        client = InProcessEngineClient(EngineConfig(model=str(model), **ENGINE_KW), model_name="fuzz")
        app = build_app(client, served_model_name="fuzz",
                        limits=ServerLimits(max_tokens_default=8, max_tokens_limit=32))
        with ServerThread(app) as srv:
            t0 = time.perf_counter()
            with tqdm(total=args.cases, desc="fuzz cases") as bar:
                report = fuzz(srv.url, app.openapi(), args.cases, seed=args.seed, progress=bar.update)
            wall = time.perf_counter() - t0
            healthy = httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
            held = (app.state.admission.held_requests, app.state.admission.held_tokens)
    print(f"cases: {report.cases} in {wall:.0f} s (seed {args.seed})")
    for name, n in sorted(report.by_operation.items()):
        print(f"  {name}: {n}")
    print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(report.by_status.items())))
    print(f"5xx: {len(report.server_errors)}; healthy after: {healthy}; admitted and unreleased: {held}")
    for err in report.server_errors[:10]:
        print("  ", err)
    return 0 if not report.server_errors and healthy and held == (0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
