"""``--cpu-layout auto|none|FILE``: what ``auto`` decides for each deployment, what a FILE may hold, and that the
serve and bench command lines hand the chosen knobs to the cluster config and the load client."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_helpers import write_cpu_layout
from tetriinfer.runtime.cpu_layout import (
    AUTO_FRONTEND_RT,
    AUTO_PREFILL_RT,
    CpuLayout,
    auto_client_layout,
    auto_layout,
    load_layout,
)
from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args


def _auto(**over: object) -> CpuLayout:
    kw: dict = dict(mode="tetriinfer", instances=2, cores_per_instance=1, device="cpu", launcher="local",
                    keep_decode=False, ncpu=2, realtime_ok=True)
    kw.update(over)
    return auto_layout(**kw)


def test_auto_on_a_full_cpu_host_is_the_measured_layout() -> None:
    disagg = _auto()
    assert (disagg.prefill_rt_priority, disagg.frontend_rt_priority, disagg.frontend_cores) == (
        AUTO_PREFILL_RT, AUTO_FRONTEND_RT, (0,))
    assert AUTO_FRONTEND_RT > AUTO_PREFILL_RT and disagg.notes
    coloc = _auto(mode="colocated")  # a real-time colocated instance would starve its front end
    assert (coloc.prefill_rt_priority, coloc.frontend_rt_priority, coloc.frontend_cores) == (None, AUTO_FRONTEND_RT, (0,))
    kept = _auto(keep_decode=True)  # a prefill instance that decodes must not hold its core
    assert kept.prefill_rt_priority is None and kept.frontend_rt_priority == AUTO_FRONTEND_RT
    wide = _auto(cores_per_instance=2, instances=2, ncpu=4)
    assert wide.frontend_cores == (0, 1)


def test_auto_skips_what_is_not_permitted_or_not_needed() -> None:
    unprivileged = _auto(realtime_ok=False)
    assert unprivileged.prefill_rt_priority is None and unprivileged.frontend_rt_priority is None
    assert unprivileged.frontend_cores == (0,) and any("not permitted" in n for n in unprivileged.notes)
    spare = _auto(ncpu=8)  # cores no instance uses: the front end goes there, nothing is prioritized
    assert spare.frontend_cores == tuple(range(2, 8)) and spare.frontend_rt_priority is None
    for over in ({"device": "cuda"}, {"launcher": "ray"}, {"mode": "single"}):
        layout = _auto(**over)
        assert layout.is_empty and layout.notes, over
    assert auto_client_layout(2, True).client_rt_priority == 20
    assert auto_client_layout(2, False).client_cores_for_run() == (0,)
    assert auto_client_layout(2, False).client_rt_priority is None
    assert auto_client_layout(16, True).is_empty


def test_layout_files_are_read_and_bad_ones_refused_by_name(tmp_path: Path) -> None:
    path = write_cpu_layout(tmp_path, instance_nice=-5, prefill_rt_priority=7, frontend_rt_priority=9,
                            frontend_cores="0", client_rt_priority=20, client_cores=["tetriinfer:0", "0"])
    layout = load_layout(path)
    assert layout == CpuLayout(instance_nice=-5, prefill_rt_priority=7, frontend_rt_priority=9, frontend_cores=(0,),
                               client_rt_priority=20, client_cores=("tetriinfer:0", "0"))
    assert "prefill_rt_priority=7" in layout.describe()
    assert load_layout("none") == CpuLayout() and load_layout("auto") is None
    bad = {"frontend_core": '"0"', "prefill_rt_priority": '"high"', "frontend_cores": "[0]",
           "client_rt_priority": "0"}
    for key, value in bad.items():
        f = tmp_path / f"bad_{key}.toml"
        f.write_text(f"{key} = {value}\n")
        with pytest.raises(ValueError, match=key.split("_core")[0]):
            load_layout(str(f))
    (tmp_path / "broken.toml").write_text("prefill_rt_priority = \n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_layout(str(tmp_path / "broken.toml"))
    with pytest.raises(FileNotFoundError, match="neither auto, none nor a TOML file"):
        load_layout(str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="columns only"):
        load_layout(path).client_cores_for_run()


def test_serve_flags_come_in_groups_and_the_layout_reaches_the_cluster_config(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    groups = add_cluster_args(p)
    assert set(groups) == {"model", "parallelism", "scheduling", "kv", "elasticity", "observability"}
    assert all(g._group_actions for g in groups.values())
    cfg = cluster_config_from_args(p.parse_args([]), "m")
    assert cfg.instance_nice is None and cfg.prefill_rt_priority is None  # default: none
    path = write_cpu_layout(tmp_path, instance_nice=3, prefill_rt_priority=4)
    cfg = cluster_config_from_args(p.parse_args(["--cpu-layout", path]), "m")
    assert (cfg.instance_nice, cfg.prefill_rt_priority) == (3, 4)
    auto = cluster_config_from_args(p.parse_args(["--cpu-layout", "auto", "--device", "cuda"]), "m")
    assert auto.prefill_rt_priority is None
    for gone in ("--prefill-rt-priority", "--frontend-cores", "--instance-nice"):
        with pytest.raises(SystemExit):
            p.parse_args([gone, "1"])


def test_serve_help_shows_the_groups_and_a_bad_layout_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "tetriinfer.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=60, env=env, check=True).stdout
    for title in ("model:", "parallelism and modes:", "scheduling:", "KV transfer:", "elasticity:",
                  "API and security:", "observability:"):
        assert f"\n{title}" in out, title
    assert "--cpu-layout" in out and "--frontend-rt-priority" not in out
    bad = subprocess.run([sys.executable, "-m", "tetriinfer.cli", "serve", "--cpu-layout", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "neither auto, none nor a TOML file" in bad.stderr


def test_bench_reads_the_client_knobs_from_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.bench.cli import client_cpu_layout

    layout = client_cpu_layout(write_cpu_layout(tmp_path, client_rt_priority=20, client_cores="0"))
    assert layout.client_rt_priority == 20 and layout.client_cores_for_run() == (0,)
    assert "client_rt_priority=20" in capsys.readouterr().err  # what it applies is logged
    assert client_cpu_layout("none").is_empty
