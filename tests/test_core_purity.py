"""``tetriinfer.core`` stays pure: no heavy or I/O dependencies, no clock reads, no global random."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import tetriinfer.core

CORE_DIR = Path(tetriinfer.core.__file__).parent
FORBIDDEN_MODULES = ["torch", "zmq", "fastapi", "uvicorn", "ray", "httpx", "transformers", "numpy", "msgspec"]
FORBIDDEN_CALLS = ["time.time(", "time.monotonic(", "time.perf_counter(", "datetime.now(", "time.sleep("]


def core_modules() -> list[str]:
    return sorted(f"tetriinfer.core.{m.name}" for m in pkgutil.iter_modules([str(CORE_DIR)]))


def test_every_core_module_imports_without_heavy_dependencies() -> None:
    mods = core_modules()
    assert "tetriinfer.core.decode_scheduler" in mods and len(mods) >= 15
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=CORE_DIR.parent.parent)
    loaded = set(__import__("json").loads(out.stdout))
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
