"""The compiled copy of the core and simulator (``scripts/build_native_sim.py``, mypyc) computes the same numbers
as the interpreted sources: the golden simulation (``test_sim_golden``) run from the compiled copy gives the golden
file byte for byte, with the native modules loaded (not their ``.py`` sources).

Building takes several minutes (mypy type-checks the package); it needs mypy and a C compiler, both installed by
the dev extras and present on the CI machine."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

if importlib.util.find_spec("mypyc") is None:  # pragma: no cover - the dev extras install mypy
    pytest.fail("mypy (with mypyc) is needed: pip install -e '.[dev]'", pytrace=False)

CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # the tests folder: test_sim_golden's run
import tetriinfer.core.decode_scheduler as ds, tetriinfer.core.load as load, tetriinfer.sim.cluster as cluster
import tetriinfer.sim.cost_model as cost_model, tetriinfer.sim.link as link
from tetriinfer.bench.workloads import shared_data_dir
from test_sim_golden import golden_json
modules = {m.__name__: m.__file__ for m in (ds, load, cluster, cost_model, link)}
print(json.dumps({"modules": modules, "golden": golden_json(), "data": str(shared_data_dir())}))
"""


def build_script() -> ModuleType:
    """``scripts/build_native_sim.py`` as a module."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("build_native_sim")
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def native_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native")
    names = build_script().build(out)
    assert "tetriinfer.core.load" in names and "tetriinfer.sim.cluster" in names
    return out


def test_compiled_copy_reproduces_the_golden_simulation_byte_for_byte(native_copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(native_copy)}
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "tests")], env=env, cwd=native_copy,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, path in out["modules"].items():  # the native modules ran, from the copy
        assert path.startswith(str(native_copy)) and path.endswith(".so"), (name, path)
    golden = (ROOT / "tests" / "fixtures" / "sim_golden.json").read_text(encoding="utf-8")
    assert out["golden"] == golden
    assert out["data"] == str(ROOT.parent / "shared" / "data")  # a copy elsewhere reads the checkout's data


SIDE_BY_SIDE = ["-m", "tetriinfer.cli", "sim", "side-by-side", "--cost", "roofline:a100-80g", "--model", "llama-2-13b",
                "--instances", "4", "-n", "60", "--no-floor", "--workloads", "lphd,mixed", "--rate-fraction", "0.7",
                "--modes", "tetriinfer,colocated", "--jobs", "2", "--no-progress"]


def test_compiled_copy_runs_columns_in_worker_processes_with_the_same_results(native_copy: Path,
                                                                               tmp_path: Path) -> None:
    """``--jobs 2`` sends the cost model to worker processes: the compiled (native) cost model pickles, and the
    columns come back as the interpreted sources compute them."""
    results = {}
    for name, tree in (("native", native_copy), ("sources", ROOT)):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, *SIDE_BY_SIDE, "--out", str(out)], cwd=tmp_path, timeout=900,
                              env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    assert results["native"]["workloads"] == results["sources"]["workloads"]


def test_build_refuses_to_write_over_the_sources() -> None:
    build_native_sim = build_script()
    with pytest.raises(ValueError, match="sources"):
        build_native_sim.build(ROOT)
    with pytest.raises(ValueError, match="sources"):
        build_native_sim.build(ROOT / "tetriinfer" / "native")
