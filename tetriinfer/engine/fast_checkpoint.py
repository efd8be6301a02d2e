"""Loading-optimized checkpoints: ServerlessLLM-style fast cold start (``--load-format fast | fast-shm``).

Why: an instance added by scale-out, a flip on a new host, or a restart after a failure waits for its weights.
The Hugging Face path (safetensors -> per-tensor copies, fused-projection assembly, dtype cast) touches every
byte several times in small pieces. This format is the engine's own parameters, already fused and cast, laid
out once so that loading is one sequential read and no copy:

- A checkpoint folder holds ``index.json`` and ``part-00000.bin``, ... (partitions of at most
  ``PARTITION_BYTES``). Each engine parameter (names after fusion, e.g. ``layers.0.attn.qkv_proj.weight``) is a
  contiguous run of bytes at an ``ALIGN``-aligned offset of one partition, in the load dtype.
- Load = allocate one host buffer for all partitions, fill it with ``num_readers`` threads issuing large
  ``preadv`` calls (the GIL is released while they read), then make every parameter a *view* of the buffer.
  On CPU that is the model: no further copy. On CUDA the buffer is pinned and copied to the device in one go.
- ``fast-shm`` adds ServerlessLLM's host-memory tier for many instances on one host: the first instance reads
  the partitions into ``/dev/shm`` (under a file lock, published by rename), every later instance -- another
  process of the same cluster, a scaled-out or flipped instance -- maps that file (``MAP_SHARED``) and is
  ready in milliseconds, and the weights occupy host memory once, not once per instance.
- Checkpoints live in a local cache (``<cache>/checkpoints/<digest>``), made from the HF folder on first use
  by ``loader.ensure_checkpoint`` (one normal load, then a write; this module never imports the loader) and
  keyed by the source folder's path, weight files (names, sizes, mtimes), config and dtype: a changed source makes a new checkpoint instead of loading stale weights.

Safety: the index is JSON, validated against the model being built (every parameter exactly once, shapes and
dtype equal, every byte range inside its partition); nothing is unpickled. Shared (``fast-shm``) weights are
mapped read-write by torch but never written: inference only reads parameters.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tetriinfer.engine.huge_pages import huge_page_buffer, huge_pages_available
from tetriinfer.engine.weight_files import weight_files

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIGN = 4096  # page-aligned tensors: every view is aligned and partitions can be read with large requests
PARTITION_BYTES = 1 << 30
READ_CHUNK_BYTES = 32 << 20  # one preadv per 32 MiB: large sequential requests, enough pieces for parallel readers
SHM_DIR = Path("/dev/shm")
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorEntry:
    partition: int
    offset: int  # bytes from the start of the partition
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CheckpointIndex:
    """``index.json``: where each engine parameter's bytes are. ``aliases``: tied parameters (name -> owner)."""

    partitions: tuple[int, ...]  # byte size of each partition file
    tensors: dict[str, TensorEntry]
    aliases: dict[str, str]
    source: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(self.partitions)

    def partition_starts(self) -> list[int]:
        """Offset of each partition in the single load buffer (partitions back to back)."""
        starts, pos = [], 0
        for size in self.partitions:
            starts.append(pos)
            pos += size
        return starts

    def to_json(self) -> dict[str, Any]:
        return {"format": "tetriinfer-fast-checkpoint", "version": FORMAT_VERSION, "partitions": list(self.partitions),
                "tensors": {k: {"partition": e.partition, "offset": e.offset, "nbytes": e.nbytes,
                                "shape": list(e.shape), "dtype": e.dtype} for k, e in self.tensors.items()},
                "aliases": self.aliases, "source": self.source}

    @staticmethod
    def from_json(data: dict[str, Any]) -> CheckpointIndex:
        if data.get("format") != "tetriinfer-fast-checkpoint" or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a version-{FORMAT_VERSION} tetriinfer fast checkpoint index")
        partitions = tuple(int(p) for p in data["partitions"])
        tensors: dict[str, TensorEntry] = {}
        for name, e in data["tensors"].items():
            entry = TensorEntry(int(e["partition"]), int(e["offset"]), int(e["nbytes"]),
                                tuple(int(d) for d in e["shape"]), str(e["dtype"]))
            if entry.dtype not in NAME_DTYPES:
                raise ValueError(f"{name}: unsupported dtype {entry.dtype!r}")
            itemsize = torch.empty((), dtype=NAME_DTYPES[entry.dtype]).element_size()
            if entry.nbytes != math.prod(entry.shape) * itemsize:
                raise ValueError(f"{name}: {entry.nbytes} bytes do not hold shape {entry.shape} of {entry.dtype}")
            if not 0 <= entry.partition < len(partitions) or entry.offset < 0 or entry.offset % ALIGN \
                    or entry.offset + entry.nbytes > partitions[entry.partition]:
                raise ValueError(f"{name}: byte range outside its partition")
            tensors[name] = entry
        aliases = {str(k): str(v) for k, v in data.get("aliases", {}).items()}
        if any(v not in tensors for v in aliases.values()):
            raise ValueError("an alias points at a tensor the checkpoint does not hold")
        return CheckpointIndex(partitions, tensors, aliases, dict(data.get("source", {})))


@dataclass(frozen=True)
class LoadStats:
    """How a fast load went: ``tier`` is ``disk`` (read from the partition files) or ``shm`` (mapped)."""

    tier: str
    bytes: int
    seconds: float
    num_readers: int
    converted_s: float = 0.0  # > 0 when this load first had to make the checkpoint

    @property
    def gib_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 2**30


# ---- source fingerprint and cache location ------------------------------------------------------------


def source_fingerprint(model_dir: str | Path, dtype: torch.dtype) -> dict[str, Any]:
    """What a checkpoint was made from: the folder, its config and weight files (name, size, mtime), dtype."""
    folder = Path(model_dir).expanduser().resolve()
    config = (folder / "config.json").read_bytes()
    files = [{"name": f.name, "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
             for f in weight_files(folder)]
    return {"model_dir": str(folder), "config_sha256": hashlib.sha256(config).hexdigest(), "weight_files": files,
            "dtype": DTYPE_NAMES[dtype]}


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]


def checkpoint_cache_dir() -> Path:
    from tetriinfer.engine.make_model import cache_dir

    return cache_dir() / "checkpoints"


def cached_checkpoint_path(model_dir: str | Path, dtype: torch.dtype) -> Path:
    return checkpoint_cache_dir() / fingerprint_digest(source_fingerprint(model_dir, dtype))


def read_index(ckpt_dir: str | Path) -> CheckpointIndex:
    path = Path(ckpt_dir) / "index.json"
    index = CheckpointIndex.from_json(json.loads(path.read_text(encoding="utf-8")))
    for i, size in enumerate(index.partitions):
        part = Path(ckpt_dir) / partition_name(i)
        if not part.is_file() or part.stat().st_size != size:
            raise ValueError(f"fast checkpoint {ckpt_dir}: partition {part.name} is missing or truncated")
    return index


def partition_name(i: int) -> str:
    return f"part-{i:05d}.bin"


# ---- writing -----------------------------------------------------------------------------------------------


def plan_layout(params: list[tuple[str, torch.Tensor]], partition_bytes: int = PARTITION_BYTES,
                ) -> tuple[tuple[int, ...], dict[str, TensorEntry]]:
    """Place tensors in order, each at an ALIGN-aligned offset; a new partition starts when the next tensor
    would cross ``partition_bytes`` (a tensor larger than that gets a partition of its own)."""
    sizes: list[int] = [0]
    entries: dict[str, TensorEntry] = {}
    for name, t in params:
        nbytes = t.numel() * t.element_size()
        offset = -(-sizes[-1] // ALIGN) * ALIGN
        if offset + nbytes > partition_bytes and sizes[-1] > 0:
            sizes.append(0)
            offset = 0
        entries[name] = TensorEntry(len(sizes) - 1, offset, nbytes, tuple(t.shape), DTYPE_NAMES[t.dtype])
        sizes[-1] = offset + nbytes
    return tuple(-(-s // ALIGN) * ALIGN for s in sizes), entries


def write_checkpoint(model: nn.Module, out_dir: str | Path, source: dict[str, Any],
                     partition_bytes: int = PARTITION_BYTES) -> CheckpointIndex:
    """Write ``model``'s parameters (CPU, one dtype) as a fast checkpoint; atomic (staged, then renamed)."""
    out = Path(out_dir)
    owners: dict[int, str] = {}
    params: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = p.data_ptr()
        if key in owners:
            aliases[name] = owners[key]
            continue
        owners[key] = name
        params.append((name, p.detach().contiguous()))
    partitions, entries = plan_layout(params, partition_bytes)
    index = CheckpointIndex(partitions, entries, aliases, source)
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}"
    stage.mkdir(parents=True, exist_ok=False)
    try:
        files = [open(stage / partition_name(i), "wb") for i in range(len(partitions))]  # noqa: SIM115
        try:
            for name, t in params:
                e = entries[name]
                f = files[e.partition]
                f.seek(e.offset)
                f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
            for f, size in zip(files, partitions, strict=True):
                f.truncate(size)
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in files:
                f.close()
        (stage / "index.json").write_text(json.dumps(index.to_json(), indent=1), encoding="utf-8")
        try:
            os.replace(stage, out)
        except OSError:  # another process published the same checkpoint first: keep theirs
            if not (out / "index.json").is_file():
                raise
    finally:
        if stage.exists():
            for child in stage.iterdir():
                child.unlink()
            stage.rmdir()
    return index


# ---- reading -----------------------------------------------------------------------------------------------


def read_into(ckpt_dir: Path, index: CheckpointIndex, buffer: torch.Tensor, num_readers: int) -> None:
    """Fill ``buffer`` (uint8, ``index.total_bytes``) with the partitions, back to back, using ``num_readers``
    threads that each issue ``preadv`` calls of ``READ_CHUNK_BYTES``."""
    view = memoryview(buffer.numpy())
    jobs: list[tuple[int, int, int, int]] = []  # (partition, file offset, buffer offset, nbytes)
    for i, (start, size) in enumerate(zip(index.partition_starts(), index.partitions, strict=True)):
        for off in range(0, size, READ_CHUNK_BYTES):
            jobs.append((i, off, start + off, min(READ_CHUNK_BYTES, size - off)))
    fds = [os.open(ckpt_dir / partition_name(i), os.O_RDONLY) for i in range(len(index.partitions))]
    try:
        def read(job: tuple[int, int, int, int]) -> None:
            part, file_off, buf_off, n = job
            done = 0
            while done < n:
                got = os.preadv(fds[part], [view[buf_off + done: buf_off + n]], file_off + done)
                if got <= 0:
                    raise OSError(f"short read in {partition_name(part)} at {file_off + done}")
                done += got

        if num_readers <= 1:
            for job in jobs:
                read(job)
        else:
            with ThreadPoolExecutor(num_readers, thread_name_prefix="ckpt-read") as pool:
                list(pool.map(read, jobs))
    finally:
        for fd in fds:
            os.close(fd)


def shm_path(ckpt_dir: Path) -> Path:
    """Where ``fast-shm`` keeps this checkpoint's bytes in host memory."""
    return SHM_DIR / f"tetriinfer-weights-{ckpt_dir.name}.bin"


def _shm_buffer(ckpt_dir: Path, index: CheckpointIndex, num_readers: int) -> tuple[torch.Tensor, str]:
    """The checkpoint's bytes in ``/dev/shm``, mapped shared: read from disk by the first caller on this host
    (under an exclusive lock; published by rename), mapped by every later one. Returns (buffer, tier)."""
    path = shm_path(ckpt_dir)
    tier = "shm"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file() or path.stat().st_size != index.total_bytes:
            tier = "disk"
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            try:
                staging = torch.from_file(str(tmp), shared=True, size=index.total_bytes, dtype=torch.uint8)
                read_into(ckpt_dir, index, staging, num_readers)
                del staging
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()
    return torch.from_file(str(path), shared=True, size=index.total_bytes, dtype=torch.uint8), tier


def _shm_fits(ckpt_dir: Path, index: CheckpointIndex) -> bool:
    """Whether the host-memory copy exists or fits in ``SHM_DIR`` (a container's /dev/shm is often 64 MiB: writing
    past it would kill the process with SIGBUS, so the load falls back to the disk tier instead)."""
    path = shm_path(ckpt_dir)
    if path.is_file() and path.stat().st_size == index.total_bytes:
        return True
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= index.total_bytes + (64 << 20)


def evict_shm(ckpt_dir: str | Path | None = None) -> list[Path]:
    """Remove the ``/dev/shm`` copies (of one checkpoint, or all of ours); mapped instances keep theirs."""
    pattern = f"tetriinfer-weights-{Path(ckpt_dir).name}.*" if ckpt_dir else "tetriinfer-weights-*"
    removed = []
    for p in SHM_DIR.glob(pattern):
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def default_readers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def attach(model: nn.Module, index: CheckpointIndex, buffer: torch.Tensor) -> None:
    """Make every parameter of ``model`` a view of ``buffer`` (validated against the index first)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    want = {n for n in params if n not in index.aliases}
    have = set(index.tensors)
    if want != have:
        raise ValueError(f"fast checkpoint does not match the model: missing {sorted(want - have)[:5]}, "
                         f"unexpected {sorted(have - want)[:5]}")
    starts = index.partition_starts()
    views: dict[str, torch.Tensor] = {}
    for name, e in index.tensors.items():
        p = params[name]
        if tuple(p.shape) != e.shape:
            raise ValueError(f"{name}: checkpoint shape {e.shape} != model shape {tuple(p.shape)}")
        begin = starts[e.partition] + e.offset
        views[name] = buffer[begin: begin + e.nbytes].view(NAME_DTYPES[e.dtype]).view(e.shape)
    for name in params:
        owner = index.aliases.get(name, name)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._parameters[attr] = nn.Parameter(views[owner], requires_grad=False)


def load_fast(model: nn.Module, ckpt_dir: str | Path, device: str = "cpu", shm: bool = False,
              num_readers: int | None = None) -> LoadStats:
    """Load a fast checkpoint into ``model`` (built with the right shapes; its parameters are replaced)."""
    ckpt = Path(ckpt_dir)
    index = read_index(ckpt)
    readers = num_readers or default_readers()
    t0 = time.perf_counter()
    if shm and device == "cpu" and not _shm_fits(ckpt, index):
        log.warning("%s has room for less than %.2f GiB: loading %s from disk, unshared", SHM_DIR,
                    index.total_bytes / 2**30, ckpt)
        shm = False
    if shm and device == "cpu":
        buffer, tier = _shm_buffer(ckpt, index, readers)
        model.shared_weight_mapping = True  # one copy for every instance of the host: never moved to private memory
    else:
        tier = "disk"
        pin = device.startswith("cuda") and torch.cuda.is_available()
        if device == "cpu":  # the weights stay in this buffer: on huge pages, as `move_weights_to_huge_pages` puts them
            buffer = huge_page_buffer(index.total_bytes)
            if huge_pages_available():
                model.huge_page_ranges = [(buffer.data_ptr(), buffer.data_ptr() + index.total_bytes)]
        else:
            buffer = torch.empty(index.total_bytes, dtype=torch.uint8, pin_memory=pin)
        read_into(ckpt, index, buffer, readers)
        if device != "cpu":
            buffer = buffer.to(device, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(device)
    attach(model, index, buffer)
    return LoadStats(tier, index.total_bytes, time.perf_counter() - t0, readers)
