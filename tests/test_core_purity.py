"""``tetriinfer.core`` stays pure: no heavy or I/O dependencies, no clock reads, no global random.
``tetriinfer.sim`` and ``tetriinfer.model_config`` stay torch-free: the simulator never loads the engine."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import tetriinfer.core
import tetriinfer.sim

CORE_DIR = Path(tetriinfer.core.__file__).parent
FORBIDDEN_MODULES = ["torch", "zmq", "fastapi", "uvicorn", "ray", "httpx", "transformers", "numpy", "msgspec"]
FORBIDDEN_CALLS = ["time.time(", "time.monotonic(", "time.perf_counter(", "datetime.now(", "time.sleep("]


def core_modules() -> list[str]:
    return sorted(f"tetriinfer.core.{m.name}" for m in pkgutil.iter_modules([str(CORE_DIR)]))


def loaded_after_importing(mods: list[str]) -> set[str]:
    """Every module in ``sys.modules`` after a fresh interpreter imports ``mods``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=CORE_DIR.parent.parent)
    return set(json.loads(out.stdout))


def test_every_core_module_imports_without_heavy_dependencies() -> None:
    mods = core_modules()
    assert "tetriinfer.core.decode_scheduler" in mods and len(mods) >= 15
    loaded = loaded_after_importing(mods)
    bad = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN_MODULES)
    assert not bad, f"tetriinfer.core pulled in {bad}"
    assert not any(m.startswith("tetriinfer.") and not m.startswith("tetriinfer.core") for m in loaded)


def test_no_clock_reads_threads_sockets_or_global_random_in_core() -> None:
    for path in sorted(CORE_DIR.glob("*.py")):
        src = path.read_text()
        for call in FORBIDDEN_CALLS:
            assert call not in src, f"{path.name} calls {call}"
        for mod in ("threading", "socket", "asyncio", "time", "datetime"):
            assert not re.search(rf"^\s*(import|from)\s+{mod}\b", src, re.M), f"{path.name} imports {mod}"
        # Randomness only through seeded ``random.Random`` instances.
        for m in re.finditer(r"\brandom\.(\w+)\(", src):
            assert m.group(1) == "Random", f"{path.name} uses global random.{m.group(1)}"


def test_simulator_imports_neither_torch_nor_the_engine() -> None:
    sim_dir = Path(tetriinfer.sim.__file__).parent
    mods = sorted(f"tetriinfer.sim.{m.name}" for m in pkgutil.iter_modules([str(sim_dir)]))
    assert "tetriinfer.sim.cost_model" in mods and "tetriinfer.sim.cli" in mods
    loaded = loaded_after_importing([*mods, "tetriinfer.model_config"])
    assert "tetriinfer.sim.cost_model" in loaded
    bad = sorted(m for m in loaded if m.split(".")[0] in ("torch", "transformers", "safetensors")
                 or m.startswith("tetriinfer.engine"))
    assert not bad, f"tetriinfer.sim pulled in {bad[:10]}"
