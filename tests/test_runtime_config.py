"""Cluster/engine settings that are resolved per device: chunk padding and the CPU allocator tuning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.runtime.cluster_config import ClusterConfig, pads_last_chunk


def test_chunk_padding_resolves_per_device() -> None:
    assert pads_last_chunk("full", "cpu") and pads_last_chunk("full", "cuda")
    assert not pads_last_chunk("none", "cpu") and not pads_last_chunk("none", "cuda")
    assert not pads_last_chunk("auto", "cpu")  # CPU forward time grows with every padded token
    assert pads_last_chunk("auto", "cuda")  # accelerators: a short forward costs a full one anyway
    assert ClusterConfig(model="m").pad_last_chunk is False
    assert ClusterConfig(model="m", chunk_padding="full").pad_last_chunk is True
    with pytest.raises(ValueError, match="chunk_padding"):
        ClusterConfig(model="m", chunk_padding="some")


def test_prefill_merge_limit_reaches_the_prefill_worker_from_the_command_line() -> None:
    import argparse

    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    p = argparse.ArgumentParser()
    add_cluster_args(p)
    cfg = cluster_config_from_args(p.parse_args(["--prefill-merge-limit", "128"]), "m")
    assert cfg.prefill_merge_limit == 128
    assert cluster_config_from_args(p.parse_args([]), "m").prefill_merge_limit is None  # the paper: fill chunks
    with pytest.raises(ValueError, match="prefill_merge_limit"):
        ClusterConfig(model="m", prefill_merge_limit=0)


def test_prefill_tail_merge_is_a_quarter_chunk_under_the_adaptive_controller_and_off_for_the_paper() -> None:
    import argparse

    from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args

    p = argparse.ArgumentParser()
    add_cluster_args(p)

    def tail(*argv: str) -> int:
        return cluster_config_from_args(p.parse_args(list(argv)), "m").prefill_tail_tokens

    assert tail("--mode", "tetriinfer") == 128  # --pd-controller adaptive by default
    assert tail("--mode", "tetriinfer", "--chunk-size", "256") == 64
    assert tail("--mode", "tetriinfer", "--pd-controller", "static") == 0  # the paper's fixed chunks
    assert tail("--mode", "tetriinfer", "--prefill-tail-tokens", "0") == 0
    assert tail("--mode", "distserve") == 0
    with pytest.raises(ValueError, match="prefill_tail_tokens"):
        ClusterConfig(model="m", prefill_tail_tokens=-1)


@pytest.mark.parametrize("pad", [True, False])
def test_prefill_scheduler_pads_only_when_asked(pad: bool) -> None:
    kv = KVCacheManager(64, 16)
    sched = PrefillScheduler(PrefillSchedulerConfig(chunk_size=128, max_model_len=1024, pad_last_chunk=pad), kv)
    sched.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=4), arrival_time=0.0))
    out = sched.schedule()
    assert sum(s.num_tokens for s in out.segments) == 40
    assert out.num_padding_tokens == (88 if pad else 0)


def test_cpu_allocator_tuning_is_idempotent_and_can_be_disabled() -> None:
    from tetriinfer.allocator import tune_cpu_allocator

    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt tuning applies to glibc Linux only")
    assert tune_cpu_allocator() is True
    assert tune_cpu_allocator() is True
    code = "from tetriinfer.allocator import tune_cpu_allocator; print(tune_cpu_allocator())"
    env = {**os.environ, "TETRIINFER_MALLOC_TUNING": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
