"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis): every generated request must get a non-5xx answer.

``fuzz(base_url, schema, cases, seed)`` spreads ``cases`` over the schema's operations (more to the two generation
routes), half schema-valid bodies and half schema-violating ones, each operation's cases derandomized from ``seed``
(the same run every time). Returns per-operation counts and every 5xx seen. Used by a test (a small count) and by
``scripts/fuzz_api.py`` (the full count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WEIGHTS = {"/v1/completions": 6, "/v1/chat/completions": 6}


@dataclass
class FuzzReport:
    cases: int = 0
    by_operation: dict[str, int] = field(default_factory=dict)
    by_status: dict[int, int] = field(default_factory=dict)
    server_errors: list[tuple[str, int, str]] = field(default_factory=list)  # (operation, status, body head)


def fuzz(base_url: str, schema_dict: dict[str, Any], cases: int, seed: int = 0,
         progress: Callable[[int], None] | None = None) -> FuzzReport:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(schema_dict)
    ops = [r.ok() for r in schema.get_all_operations()]
    total_weight = sum(WEIGHTS.get(op.path, 1) for op in ops) * 2  # positive and negative
    report = FuzzReport()
    for attempt in range(8):  # operations with little to vary (no parameters) run out early: pass again, reseeded
        left = cases - report.cases
        if left <= 0:
            break
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                n = max(1, round(left * WEIGHTS.get(op.path, 1) / total_weight))
                name = f"{op.method.upper()} {op.path} ({mode.value})"
                _run_operation(op, mode, name, n, seed + attempt, base_url, report, progress)
    return report


def _run_operation(op: Any, mode: Any, name: str, n: int, seed: int, base_url: str, report: FuzzReport,
                   progress: Callable[[int], None] | None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        r = case.call(base_url=base_url, timeout=120)
        report.cases += 1
        report.by_operation[name] = report.by_operation.get(name, 0) + 1
        report.by_status[r.status_code] = report.by_status.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            report.server_errors.append((name, r.status_code, r.text[:300]))
        if progress is not None:
            progress(1)

    try:
        run()
    except Unsatisfiable:  # nothing to violate in this operation's schema (e.g. no parameters, no body)
        pass
