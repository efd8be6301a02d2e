"""Golden output of a fixed simulated side-by-side run: the simulator's numbers must not move by a single byte
when its code is made faster. The golden file is rewritten only on purpose:
``python tests/test_sim_golden.py --write`` (after a change that is meant to alter simulated numbers; say why in
the commit).

The run: the first 200 requests of the Azure conversation trace (``fixtures/azure_conv_head200.csv``) at 70% of
the probed colocated capacity, Llama-3-8B on four simulated A100-80GB (2 prefill + 2 decode), columns
tetriinfer (flips, keep-decode, local prefill, oracle predictor at 80% accuracy), distserve (flips), colocated
and sarathi, with the floor. The golden JSON holds the whole result (wall-clock fields dropped) and, per column,
a digest of every request's record (arrival, first token, every token time, finish). The simulator's event
count is left out: it measures the simulator's work (steady decode runs take one event for many steps).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
GOLDEN = HERE / "fixtures" / "sim_golden.json"
TRACE = HERE / "fixtures" / "azure_conv_head200.csv"
WALL_CLOCK_KEYS = ("wall_s", "started_at")
SIMULATOR_WORK_KEYS = ("events",)  # how much work the simulator did, not a simulated number


def _drop_keys(obj: Any, keys: tuple[str, ...]) -> None:
    if isinstance(obj, dict):
        for key in keys:
            obj.pop(key, None)
        for value in obj.values():
            _drop_keys(value, keys)
    elif isinstance(obj, list):
        for value in obj:
            _drop_keys(value, keys)


def golden_config(jobs: int = 1) -> Any:
    from tetriinfer.bench.side_by_side import parse_columns
    from tetriinfer.sim.side_by_side import SimSideBySideConfig

    cols = parse_columns("tetriinfer,distserve,colocated,sarathi", [], [
        "tetriinfer:--flip --flip-window 1 --keep-decode --local-prefill --predictor oracle",
        "distserve:--flip --flip-window 1",
    ])
    return SimSideBySideConfig((f"trace:{TRACE}",), cols, num_kv_blocks=2000, kv_bytes_per_token=131072,
                               max_model_len=8192, model="llama-3-8b", num_requests=200, probe_requests=32,
                               probe_concurrency=8, instances=4, prefill_instances=2, predictor_accuracy=0.8,
                               seed=7, progress=False, jobs=jobs)


def golden_json(jobs: int = 1) -> str:
    """The golden run's result as canonical JSON text (sorted keys, fixed float repr); ``jobs``: columns
    simulated in that many worker processes."""
    from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, model_config
    from tetriinfer.sim.side_by_side import SimSideBySide

    cost = RooflineCostModel(model_config("llama-3-8b"), HARDWARE_PRESETS["a100-80g"], dtype_bytes=2,
                             step_overhead_s=0.003)
    result, raw = SimSideBySide(golden_config(jobs), cost, "golden").run()
    for key in WALL_CLOCK_KEYS:
        result["meta"].pop(key)
    _drop_keys(result, SIMULATOR_WORK_KEYS)
    digests = {wl: {label: hashlib.sha256(json.dumps(col["requests"], sort_keys=True).encode()).hexdigest()
                    for label, col in cols.items()} for wl, cols in raw.items()}
    text = json.dumps({"result": result, "request_digests": digests}, sort_keys=True, indent=1) + "\n"
    return text.replace(str(TRACE), "tests/fixtures/" + TRACE.name)  # the same file wherever the checkout is


def test_simulated_numbers_match_the_golden_file_byte_for_byte() -> None:
    text = golden_json()
    data = json.loads(text)
    cells = next(iter(data["result"]["workloads"].values()))
    assert set(cells) == {"tetriinfer", "distserve", "colocated", "sarathi"}
    assert all(c["completed"] == 200 and c["failed"] == 0 for c in cells.values())
    expected = GOLDEN.read_text(encoding="utf-8")
    assert text == expected, "simulated numbers changed; if meant, rewrite with python tests/test_sim_golden.py --write"


def test_columns_in_worker_processes_give_the_serial_result_byte_for_byte() -> None:
    from dataclasses import replace

    from tetriinfer.sim.cost_model import HARDWARE_PRESETS, RooflineCostModel, model_config
    from tetriinfer.sim.side_by_side import SimSideBySide

    cost = RooflineCostModel(model_config("llama-3-8b"), HARDWARE_PRESETS["a100-80g"])
    small = replace(golden_config(), num_requests=60, rate=4.0, floor=False)

    def run(jobs: int) -> str:
        result, raw = SimSideBySide(replace(small, jobs=jobs), cost, "jobs").run()
        for key in WALL_CLOCK_KEYS:
            result["meta"].pop(key)
        return json.dumps([result, raw], sort_keys=True)

    serial = run(1)
    assert '"completed": 60' in serial and run(3) == serial


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_sim_golden.py --write  (rewrites tests/fixtures/sim_golden.json)")
    GOLDEN.write_text(golden_json(), encoding="utf-8")
    print(f"wrote {GOLDEN}")
