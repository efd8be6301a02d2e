"""Shared-memory staging for the shm backend: files in /dev/shm, mapped with mmap (no resource_tracker, no pickling).

`ShmStager` (sending side) owns segments: it creates, reuses (pool) and unlinks them. Invariant: every segment it
created is unlinked by `shutdown()`; `in_use` counts segments handed out and not yet released.
`ShmMapper` (receiving side) only maps segments by name, read-only use, and unmaps them on eviction/shutdown.
"""

from __future__ import annotations

import mmap
import os
import uuid
import weakref
from collections import OrderedDict

import numpy as np

from tetriinfer.transfer.messages import ShmRef

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tetrixfer-"
_MIN_SEGMENT = 1 << 20
_ALIGN = 64


def _size_class(nbytes: int) -> int:
    size = _MIN_SEGMENT
    while size < nbytes:
        size <<= 1
    return size


class _Segment:
    __slots__ = ("name", "size", "mm", "arr")

    def __init__(self, name: str, size: int) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
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
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


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
    """Maps peers' staging segments by name (LRU-bounded by total mapped bytes). Not thread-safe."""

    def __init__(self, max_mapped_bytes: int = 512 << 20) -> None:
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._bytes = 0

    def _get(self, name: str) -> mmap.mmap:
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise ValueError(f"refusing to map unexpected shared-memory name {name!r}")
        mm = self._maps.get(name)
        if mm is not None:
            self._maps.move_to_end(name)
            return mm
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[name] = mm
        self._bytes += size
        while self._bytes > self.max_mapped_bytes and len(self._maps) > 1:
            old_name, old = self._maps.popitem(last=False)
            self._bytes -= len(old)
            try:
                old.close()
            except BufferError:
                pass
        return mm

    def views(self, refs: list[ShmRef]) -> list[np.ndarray]:
        out = []
        for r in refs:
            mm = self._get(r.name)
            if r.offset < 0 or r.offset + r.nbytes > len(mm):
                raise ValueError(f"shm ref {r} lies outside its segment ({len(mm)} bytes)")
            out.append(np.frombuffer(mm, dtype=np.uint8, count=r.nbytes, offset=r.offset))
        return out

    def forget(self, name: str) -> None:
        mm = self._maps.pop(name, None)
        if mm is not None:
            self._bytes -= len(mm)
            try:
                mm.close()
            except BufferError:
                pass

    def shutdown(self) -> None:
        for name in list(self._maps):
            self.forget(name)


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
