"""Loading-optimized checkpoints (``--load-format fast | fast-shm``): exact weights, cache, validation, sharing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.serve_helpers import ServeProcess
from tetriinfer.engine import fast_checkpoint as fc
from tetriinfer.engine.loader import ensure_checkpoint, load_model
from tetriinfer.engine.make_model import make_model


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TETRIINFER_CACHE", str(root))
    return root


@pytest.fixture()
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(fc, "SHM_DIR", d)
    return d


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters(remove_duplicate=False)), dict(b.named_parameters(remove_duplicate=False))
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_loads_are_bit_identical_to_the_hf_folder_and_cached(
    tiny_models: dict[str, Path], cache: Path, shm_dir: Path, arch: str, dtype: str
) -> None:
    ref, _ = load_model(tiny_models[arch], dtype, "cpu", "auto")
    first, _ = load_model(tiny_models[arch], dtype, "cpu", "fast")
    assert first.load_stats.converted_s > 0 and first.load_stats.tier == "disk"
    second, _ = load_model(tiny_models[arch], dtype, "cpu", "fast")
    assert second.load_stats.converted_s == 0  # made once, then read from the cache
    shared_a, _ = load_model(tiny_models[arch], dtype, "cpu", "fast-shm")
    shared_b, _ = load_model(tiny_models[arch], dtype, "cpu", "fast-shm")
    assert (shared_a.load_stats.tier, shared_b.load_stats.tier) == ("disk", "shm")
    for model in (first, second, shared_a, shared_b):
        same_parameters(ref, model)
    # every byte of the shm copy is the checkpoint's; the mapped model reads exactly those bytes
    (ckpt,) = [p for p in (cache / "checkpoints").iterdir() if p.is_dir()]
    index = fc.read_index(ckpt)
    assert fc.shm_path(ckpt).stat().st_size == index.total_bytes
    ids = torch.arange(3, 19)
    with torch.inference_mode():
        assert torch.equal(ref.embed_tokens(ids), shared_b.embed_tokens(ids))
    assert fc.evict_shm(ckpt) and not fc.shm_path(ckpt).exists()


def test_generation_from_a_fast_checkpoint_matches_the_hf_folder(tiny_llama: Path, cache: Path, shm_dir: Path) -> None:
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.engine.llm import LLM

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for fmt in ("auto", "fast-shm"):
        llm = LLM(str(tiny_llama), load_format=fmt)
        outs[fmt] = [o.outputs[0].token_ids for o in llm.generate(["The capital of", "1 2 3 4"], params)]
    assert outs["auto"] == outs["fast-shm"] and all(len(t) == 12 for t in outs["auto"])


def test_a_changed_source_makes_a_new_checkpoint(tmp_path: Path, cache: Path) -> None:
    model = make_model("llama", "tiny", tmp_path / "m", seed=0)
    path_a, _ = ensure_checkpoint(model, torch.float32)
    assert ensure_checkpoint(model, torch.float32) == (path_a, 0.0)
    assert ensure_checkpoint(model, torch.bfloat16)[0] != path_a  # another dtype, another checkpoint
    make_model("llama", "tiny", model, seed=1, force=True)  # new weights in the same folder
    path_b, seconds = ensure_checkpoint(model, torch.float32)
    assert path_b != path_a and seconds > 0
    new, _ = load_model(model, "float32", "cpu", "fast")
    ref, _ = load_model(model, "float32", "cpu", "auto")
    same_parameters(ref, new)


def test_layout_is_aligned_and_split_into_partitions(tiny_llama: Path, tmp_path: Path) -> None:
    model, _ = load_model(tiny_llama, "float32", "cpu", "auto")
    index = fc.write_checkpoint(model, tmp_path / "ck", {"test": True}, partition_bytes=8 << 20)
    assert len(index.partitions) > 1 and all(size <= 8 << 20 or size % fc.ALIGN == 0 for size in index.partitions)
    spans: dict[int, list[tuple[int, int]]] = {}
    for e in index.tensors.values():
        assert e.offset % fc.ALIGN == 0 and e.offset + e.nbytes <= index.partitions[e.partition]
        spans.setdefault(e.partition, []).append((e.offset, e.offset + e.nbytes))
    for runs in spans.values():  # no two tensors overlap
        runs.sort()
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:], strict=False))
    for readers in (1, 3):
        fresh, _ = load_model(tiny_llama, "float32", "cpu", "dummy")
        stats = fc.load_fast(fresh, tmp_path / "ck", num_readers=readers)
        assert stats.bytes == index.total_bytes
        same_parameters(model, fresh)


def test_bad_checkpoints_are_refused_with_clear_errors(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model, _ = load_model(tiny_models["llama"], "float32", "cpu", "auto")
    ck = tmp_path / "ck"
    fc.write_checkpoint(model, ck, {})
    raw = json.loads((ck / "index.json").read_text())
    name = next(iter(raw["tensors"]))

    def write(mutate) -> None:
        data = json.loads(json.dumps(raw))
        mutate(data)
        (ck / "index.json").write_text(json.dumps(data))

    fresh, _ = load_model(tiny_models["llama"], "float32", "cpu", "dummy")
    write(lambda d: d["tensors"][name].update(offset=d["partitions"][0]))
    with pytest.raises(ValueError, match="outside its partition"):
        fc.load_fast(fresh, ck)
    write(lambda d: d["tensors"][name].update(nbytes=4))
    with pytest.raises(ValueError, match="do not hold shape"):
        fc.load_fast(fresh, ck)
    write(lambda d: d.update(version=99))
    with pytest.raises(ValueError, match="not a version-1"):
        fc.load_fast(fresh, ck)
    write(lambda d: None)
    other, _ = load_model(tiny_models["opt"], "float32", "cpu", "dummy")  # a different architecture
    with pytest.raises(ValueError, match="does not match the model"):
        fc.load_fast(other, ck)
    with open(ck / fc.partition_name(0), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="missing or truncated"):
        fc.load_fast(fresh, ck)


def test_instances_starting_together_convert_once(tiny_llama: Path, cache: Path) -> None:
    code = ("import sys, json, torch; from tetriinfer.engine.loader import ensure_checkpoint; "
            "p, s = ensure_checkpoint(sys.argv[1], torch.float32); print(json.dumps([str(p), s]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_llama)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TETRIINFER_CACHE": str(cache)}) for _ in range(3)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert len({path for path, _ in results}) == 1
    assert sum(seconds > 0 for _, seconds in results) == 1
    assert [p.name for p in (cache / "checkpoints").iterdir() if p.is_dir()] == [Path(results[0][0]).name]


def test_serve_with_fast_shm_maps_one_copy_into_every_instance(tiny_llama: Path, cache: Path) -> None:
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "2", "--load-format", "fast-shm")
    try:
        (ckpt,) = [p for p in (cache / "checkpoints").iterdir() if p.is_dir()]
        shm = fc.shm_path(ckpt)
        assert shm.is_file()
        for pid in srv.child_pids():  # both instance processes map the same host-memory file
            assert str(shm) in Path(f"/proc/{pid}/maps").read_text()
        r = httpx.post(f"{srv.base_url}/v1/completions", json={
            "model": "llama", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert srv.stop() == 0
        fc.evict_shm(ckpt)


def test_fast_shm_without_room_in_host_memory_loads_from_disk(
    tiny_llama: Path, cache: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(fc.os, "statvfs", lambda path: Full())
    model, _ = load_model(tiny_llama, "float32", "cpu", "fast-shm")
    assert model.load_stats.tier == "disk" and not list(shm_dir.iterdir())  # nothing half-written
    ref, _ = load_model(tiny_llama, "float32", "cpu", "auto")
    same_parameters(ref, model)


def test_checkpoint_cli_converts_lists_and_evicts(
    tiny_llama: Path, cache: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tetriinfer.cli import main

    assert main(["checkpoint", "convert", "--model", str(tiny_llama)]) == 0
    assert "made in" in capsys.readouterr().out
    assert main(["checkpoint", "convert", "--model", str(tiny_llama)]) == 0
    assert "already cached" in capsys.readouterr().out
    load_model(tiny_llama, "float32", "cpu", "fast-shm")
    assert main(["checkpoint", "list"]) == 0
    listed = capsys.readouterr().out
    assert str(tiny_llama.resolve()) in listed and "in host memory" in listed
    assert main(["checkpoint", "evict"]) == 0
    assert "removed" in capsys.readouterr().out and not list(shm_dir.glob("*.bin"))
