"""Shared-memory staging for the shm backend: files in /dev/shm, mapped with mmap (no resource_tracker, no pickling).

`ShmStager` (sending side) owns segments: it creates, reuses (pool) and unlinks them. Invariant: every segment it
created is unlinked by `shutdown()`; `in_use` counts segments handed out and not yet released.
`ShmMapper` maps peers' segments by name (read-only to copy out, writable for a peer's arena), caches the
mappings and unmaps them on eviction, when the owner unlinked the file, or at shutdown.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from collections import OrderedDict

import numpy as np

from tetriinfer.transfer.messages import ShmRef

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tetrixfer-"
_MIN_SEGMENT = 1 << 20
_ALIGN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault pages in at map time, not one by one during a copy


def _size_class(nbytes: int) -> int:
    size = _MIN_SEGMENT
    while size < nbytes:
        size <<= 1
    return size


def close_and_unlink(mm: mmap.mmap, name: str) -> None:
    """Unmap a /dev/shm segment (if no view still holds it: the mapping then lives until the last view goes)
    and remove its file (already gone is fine)."""
    try:
        mm.close()
    except BufferError:
        pass
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class _Segment:
    __slots__ = ("name", "size", "mm", "arr")

    def __init__(self, name: str, size: int) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.name = name
        self.size = size
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)

    def destroy(self) -> None:
        self.arr = None  # type: ignore[assignment]
        close_and_unlink(self.mm, self.name)


class ShmStager:
    """Copies outgoing buffers into pooled /dev/shm segments. Not thread-safe (used by one I/O thread)."""

    def __init__(self, pool_bytes: int = 256 << 20) -> None:
        if pool_bytes < 0:
            raise ValueError(f"pool_bytes must be >= 0, got {pool_bytes}")
        self.pool_bytes = pool_bytes
        self.tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._count = 0
        self._free: dict[int, list[_Segment]] = {}
        self._free_bytes = 0
        self.in_use = 0
        # unlink our files even if the owner never calls shutdown() (exception, interpreter exit; not SIGKILL)
        self._finalizer = weakref.finalize(self, _unlink_tag, self.tag)

    @property
    def pooled(self) -> int:
        return sum(len(v) for v in self._free.values())

    def stage(self, views: list[np.ndarray]) -> tuple[_Segment, list[ShmRef]]:
        """Copy `views` back to back (64-byte aligned) into one segment; returns it and where each view lies."""
        views = [v.reshape(-1).view(np.uint8) for v in views]
        offsets = []
        pos = 0
        for v in views:
            offsets.append(pos)
            pos += (v.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        size = _size_class(max(pos, 1))
        pool = self._free.get(size)
        if pool:
            seg = pool.pop()
            self._free_bytes -= size
        else:
            self._count += 1
            seg = _Segment(f"{self.tag}{self._count}", size)
        self.in_use += 1
        refs = []
        for v, off in zip(views, offsets, strict=True):
            np.copyto(seg.arr[off:off + v.nbytes], v)
            refs.append(ShmRef(seg.name, off, v.nbytes))
        return seg, refs

    def release(self, seg: _Segment) -> None:
        self.in_use -= 1
        if self._free_bytes + seg.size <= self.pool_bytes:
            self._free.setdefault(seg.size, []).append(seg)
            self._free_bytes += seg.size
        else:
            seg.destroy()

    def shutdown(self) -> None:
        for pool in self._free.values():
            for seg in pool:
                seg.destroy()
        self._free.clear()
        self._free_bytes = 0
        self._finalizer()  # segments still in use are unlinked too (by name)


class ShmMapper:
    """Maps peers' segments by name: staging and arena segments read-only (to copy out of), peer arena segments
    writable (to copy straight into), fence files as int64 words. Mappings are cached (bounded by total mapped
    bytes, oldest evicted first) and populated up front; `prune_unlinked()` drops mappings whose file the owner has unlinked, so a
    cached mapping never keeps a freed segment's memory alive for long. Thread-safe (one internal lock); views
    it returned stay valid after eviction (the mapping lives until they are dropped)."""

    def __init__(self, max_mapped_bytes: int = 2 << 30) -> None:
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: OrderedDict[tuple[str, bool], mmap.mmap] = OrderedDict()
        self._arrs: dict[tuple[str, bool], np.ndarray] = {}  # whole-segment uint8 views: refs become slices
        self._bytes = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._maps)

    def _get(self, name: str, writable: bool = False) -> mmap.mmap:
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise ValueError(f"refusing to map unexpected shared-memory name {name!r}")
        key = (name, writable)
        mm = self._maps.get(key)
        if mm is not None:
            self._maps.move_to_end(key)
            return mm
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)
        finally:
            os.close(fd)
        self._maps[key] = mm
        self._arrs[key] = np.frombuffer(mm, dtype=np.uint8)
        if not writable:
            self._arrs[key].flags.writeable = False
        self._bytes += size
        while self._bytes > self.max_mapped_bytes and len(self._maps) > 1:
            self._drop(next(iter(self._maps)))
        return mm

    def _array(self, name: str, writable: bool) -> np.ndarray:
        arr = self._arrs.get((name, writable))
        if arr is None:
            with self._lock:
                self._get(name, writable)
                arr = self._arrs[(name, writable)]
        return arr

    def _drop(self, key: tuple[str, bool]) -> None:
        self._arrs.pop(key, None)
        mm = self._maps.pop(key, None)
        if mm is not None:
            self._bytes -= len(mm)
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass

    def views(self, refs: list[ShmRef]) -> list[np.ndarray]:
        out = []
        for r in refs:
            arr = self._array(r.name, False)
            if r.offset < 0 or r.nbytes < 0 or r.offset + r.nbytes > arr.size:
                raise ValueError(f"shm ref {r} lies outside its segment ({arr.size} bytes)")
            out.append(arr[r.offset:r.offset + r.nbytes])
        return out

    def target(self, ref: ShmRef) -> np.ndarray:
        """Writable uint8 view of a peer's arena range (the peer advertised it in a RemoteRegion)."""
        arr = self._array(ref.name, True)
        if ref.offset < 0 or ref.nbytes < 0 or ref.offset + ref.nbytes > arr.size:
            raise ValueError(f"shm ref {ref} lies outside its segment ({arr.size} bytes)")
        return arr[ref.offset:ref.offset + ref.nbytes]

    def words(self, name: str) -> np.ndarray:
        """Read-only int64 view of a whole file (a peer's fence words)."""
        arr = self._array(name, False)
        return arr[: arr.size // 8 * 8].view(np.int64)

    def prune_unlinked(self) -> int:
        """Unmap segments whose file is gone (names are never reused); returns how many were dropped."""
        with self._lock:
            gone = [k for k in self._maps if not os.path.exists(os.path.join(SHM_DIR, k[0]))]
            for key in gone:
                self._drop(key)
            return len(gone)

    def forget(self, name: str) -> None:
        with self._lock:
            for key in [(name, False), (name, True)]:
                self._drop(key)

    def shutdown(self) -> None:
        with self._lock:
            for key in list(self._maps):
                self._drop(key)


def _unlink_tag(tag: str) -> None:
    for name in leaked_segments(tag):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def leaked_segments(tag: str = SHM_PREFIX) -> list[str]:
    """Names of /dev/shm files starting with `tag` (tests use the stager's tag)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tag))
    except FileNotFoundError:
        return []
