"""Build a compiled copy of TetriInfer whose scheduling core and simulator run as native code (mypyc).

The copy is a folder holding its own ``tetriinfer/`` package: the sources of this checkout, with the modules in
``NATIVE_MODULES`` compiled next to them as extension modules (an extension module is imported before a ``.py`` of
the same name). Nothing in the checkout changes, so a compiled copy can never run stale code from the sources you
edit: build again after a change. The compiled modules are the same source files (one code path: the runtime and the
interpreted simulator run them too), and they compute the same floats: ``tests/test_sim_native.py`` checks the
golden simulation byte for byte with the compiled copy.

Use it by putting the folder first on the path:

    python scripts/build_native_sim.py --out build/native
    PYTHONPATH=build/native python -m tetriinfer.cli sim side-by-side ...
    python benchmarks/sim_speed.py --tree build/native --baseline-tree .   # compiled vs interpreted, same run

Needs mypy (``pip install mypy``; it brings mypyc) and a C compiler; takes several minutes (mypy type-checks the
package first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The modules the simulator spends its time in: every core module and the simulator's event loop, cluster,
# instances, cost models and links. Everything outside the simulator stays interpreted.
NATIVE_MODULES = (
    *(f"tetriinfer/core/{p.name}" for p in sorted((ROOT / "tetriinfer" / "core").glob("*.py"))
      if p.name != "__init__.py"),
    "tetriinfer/sim/cluster.py",
    "tetriinfer/sim/instances.py",
    "tetriinfer/sim/events.py",
    "tetriinfer/sim/cost_model.py",
    "tetriinfer/sim/link.py",
)


def build(out: Path, quiet: bool = False) -> list[str]:
    """Copy ``tetriinfer/`` into ``out`` (replacing an earlier copy) and compile ``NATIVE_MODULES`` there; returns
    the compiled module names. Raises ``RuntimeError`` with mypyc's output when the build fails."""
    out = out.resolve()
    if out == ROOT or ROOT in out.parents and out.parts[len(ROOT.parts)] == "tetriinfer":
        raise ValueError(f"{out} would overwrite the sources; pick a folder of its own")
    if (out / "tetriinfer").exists():
        shutil.rmtree(out / "tetriinfer")
    for stale in (*out.glob("*__mypyc*.so"), out / "build"):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "tetriinfer", out / "tetriinfer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    # the compiled modules are type-checked in full; what they import is only read for its types (its own errors,
    # e.g. in the engine, which is never compiled, are not this build's)
    cmd = [sys.executable, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=silent", *NATIVE_MODULES]
    env = {**os.environ, "MYPY_CACHE_DIR": str(out / "build" / ".mypy_cache")}
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    shutil.rmtree(out / "build", ignore_errors=True)
    names = [m.removesuffix(".py").replace("/", ".") for m in NATIVE_MODULES]
    # where the copy came from: it reads the checkout's shared data (``bench.workloads.shared_data_dir``)
    (out / "tetriinfer" / "NATIVE_BUILD.json").write_text(json.dumps(
        {"source_root": str(ROOT), "modules": names, "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
        indent=1) + "\n")
    missing = [n for n in names if not list((out / Path(*n.split(".")[:-1])).glob(n.split(".")[-1] + ".*.so"))]
    if missing:
        raise RuntimeError(f"mypyc finished but these modules were not built: {missing}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "native"), help="the folder to build the copy in")
    args = ap.parse_args()
    try:
        importlib.import_module("mypyc")
    except ImportError:
        sys.exit("needs mypy (it brings mypyc): pip install mypy")
    t0 = time.monotonic()
    print(f"compiling {len(NATIVE_MODULES)} modules with mypyc into {args.out} (several minutes) ...", flush=True)
    names = build(Path(args.out))
    print(f"built {len(names)} native modules in {time.monotonic() - t0:.0f} s; use: PYTHONPATH={args.out} "
          "python -m tetriinfer.cli sim ...")


if __name__ == "__main__":
    main()
