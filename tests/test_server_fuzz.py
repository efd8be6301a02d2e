"""schemathesis against the server's own OpenAPI schema (seeded, small count here; ``scripts/fuzz_api.py`` runs
1,000+): no generated request gets a 5xx, the server stays healthy and every admitted request is released."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.fuzz_helpers import fuzz
from tests.test_server_api import ENGINE_KW, ServerThread
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.runtime.inprocess import InProcessEngineClient
from tetriinfer.server.app import build_app
from tetriinfer.server.limits import ServerLimits

CASES = 200


def test_fuzzed_requests_never_get_a_5xx(tiny_llama: Path) -> None:
    client = InProcessEngineClient(EngineConfig(model=str(tiny_llama), **ENGINE_KW), model_name="fuzz")
    app = build_app(client, served_model_name="fuzz", limits=ServerLimits(max_tokens_default=8, max_tokens_limit=32))
    with ServerThread(app) as srv:
        report = fuzz(srv.url, app.openapi(), CASES, seed=1234)
        assert report.server_errors == [], report.server_errors[:5]
        assert report.cases >= CASES, report.by_operation
        assert sum(n for code, n in report.by_status.items() if 400 <= code < 500) > 0  # the negatives were refused
        assert sum(n for code, n in report.by_status.items() if code == 200) > 0  # and valid ones served
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert app.state.admission.held_requests == 0 and app.state.admission.held_tokens == 0
        assert all(i["kv_blocks_used"] == 0 for i in client.cluster_info()["instances"])
