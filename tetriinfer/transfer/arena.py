"""Receiver-side shared-memory arena: buffers that live in /dev/shm so a same-host sender copies straight into them.

`ShmArena.alloc(shape, dtype)` hands out numpy arrays or torch tensors carved from a few large pooled segments
(`{tag}a<N>` files, mapped MAP_SHARED|MAP_POPULATE). `locate(view)` tells whether a buffer (or any slice of one)
lies inside the arena and where (segment name, offset), which `recv()` advertises in the RemoteRegion so the
sender maps the segment once (cached) and memcpy's directly: one copy per byte instead of two.

Lifetime: an allocation returns to the free list when the last Python reference to it (every numpy/torch view)
is gone; the weakref finalizer only queues it, and the queue is drained under the arena lock on the next
alloc/stats call, so a finalizer can never deadlock or re-enter the allocator.

Fences: each posted region with arena slots holds one int64 word in the `{tag}fence` file, set to a fresh token
while the region is open and zeroed the moment it is dropped (DONE, FAILED, cancelled, deregistered). A sender
checks the word before every piece (`PIECE_BYTES`) it copies, so after a region closes at most one in-flight piece
can still land. Allocations of a region that did not end DONE are "tainted": when freed they sit in quarantine for
`quarantine_s` before reuse, so such a late piece can never hit memory that was handed out again.

Invariants: every file this arena created is unlinked by `shutdown()` (and by a finalizer at interpreter exit);
`bytes_in_use` counts bytes of live allocations; fully free segments above `keep_bytes` are unlinked.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from tetriinfer.transfer.freelist import FreeList
from tetriinfer.transfer.messages import ShmRef
from tetriinfer.transfer.staging import SHM_DIR, _unlink_tag, close_and_unlink

ALIGN = 4096  # allocations start on page boundaries (any dtype is aligned; copies stay page-granular)
PIECE_BYTES = 4 << 20  # a direct-writing sender re-checks the fence at least this often
FENCE_WORDS = 8192
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _create_file(name: str, size: int) -> mmap.mmap:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class _ArenaSegment:
    __slots__ = ("name", "size", "mm", "arr", "base", "free", "taints")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.mm = _create_file(name, size)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = int(self.arr.ctypes.data)
        self.free = FreeList(size)
        self.taints: list[tuple[int, int, float]] = []  # (start, end, quarantine seconds) of failed regions

    @property
    def idle(self) -> bool:
        return self.free.idle

    def take(self, nbytes: int) -> int | None:
        return self.free.take(nbytes)

    def give(self, off: int, nbytes: int) -> None:
        self.free.give(off, nbytes)

    def destroy(self) -> None:
        self.arr = None  # type: ignore[assignment]
        close_and_unlink(self.mm, self.name)


class ShmArena:
    """Pooled shared-memory allocator for receive buffers (thread-safe; see the module docstring)."""

    def __init__(self, tag: str, *, segment_bytes: int = 64 << 20, keep_bytes: int = 512 << 20,
                 quarantine_s: float = 2.0) -> None:
        if segment_bytes < ALIGN:
            raise ValueError(f"segment_bytes must be >= {ALIGN}, got {segment_bytes}")
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        if quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s}")
        self.tag = tag
        self.segment_bytes = _round_up(segment_bytes, ALIGN)
        self.keep_bytes = keep_bytes
        self.quarantine_s = quarantine_s
        self._lock = threading.Lock()
        self._segs: dict[str, _ArenaSegment] = {}
        self._bases: list[tuple[int, str]] = []  # sorted (base address, name) for locate()
        self._count = 0
        self._freed: deque[tuple[str, int, int]] = deque()  # filled by finalizers (any thread, no lock)
        self._quarantine: list[tuple[float, str, int, int]] = []
        self._in_use = 0
        self._allocs = 0
        self._fence_mm: mmap.mmap | None = None
        self._fence: np.ndarray | None = None
        self._fence_free: list[int] = []
        self._token = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_tag, tag)

    # ------------------------------------------------------------------ allocation
    def alloc_bytes(self, nbytes: int) -> np.ndarray:
        """A writable flat uint8 array of `nbytes` in shared memory (contents undefined)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            if self._closed:
                raise RuntimeError("arena is shut down")
            self._collect_locked()
            seg, off = self._place_locked(size)
            self._in_use += size
            self._allocs += 1
            # A per-allocation ctypes owner: every numpy/torch view of this memory keeps it alive (numpy collapses
            # view chains only down to it), so its finalizer runs exactly when the last view is gone.
            owner = (ctypes.c_uint8 * max(nbytes, 1)).from_buffer(seg.mm, off)
        weakref.finalize(owner, self._freed.append, (seg.name, off, size))
        return np.frombuffer(owner, dtype=np.uint8)[:nbytes]

    def alloc(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An arena-backed array: a torch tensor if `dtype` is a torch dtype, else a numpy array."""
        return self.alloc_many([shape], dtype)[0]

    def alloc_many(self, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Any]:
        """``[alloc(s, dtype) for s in shapes]`` carved from one allocation (each piece page-aligned): one lock,
        placement and finalizer for e.g. a request's 2 * num_layers KV staging tensors instead of one each. The
        memory returns to the arena when the last view of any piece is gone."""
        dims = [tuple(int(x) for x in s) for s in shapes]
        if any(x < 0 for s in dims for x in s):
            raise ValueError(f"shapes must be non-negative, got {dims}")
        torch_dtype = type(dtype).__module__.split(".")[0] == "torch"
        if torch_dtype:
            import torch

            itemsize = torch.empty((), dtype=dtype).element_size()
        else:
            np_dtype = np.dtype(dtype)
            if np_dtype.hasobject:
                raise ValueError("object dtypes cannot live in shared memory")
            itemsize = np_dtype.itemsize
        sizes = [int(np.prod(s, dtype=np.int64)) * itemsize for s in dims]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += _round_up(max(n, 1), ALIGN)
        raw = self.alloc_bytes(total)
        out = []
        for shape, start, n in zip(dims, starts, sizes, strict=True):
            piece = raw[start : start + n]
            if torch_dtype:
                out.append(torch.from_numpy(piece).view(dtype).view(shape))
            else:
                out.append(piece.view(np_dtype).reshape(shape))
        return out

    def _place_locked(self, size: int) -> tuple[_ArenaSegment, int]:
        for seg in self._segs.values():
            off = seg.take(size)
            if off is not None:
                return seg, off
        self._count += 1
        seg = _ArenaSegment(f"{self.tag}a{self._count}", max(self.segment_bytes, _round_up(size, 2 << 20)))
        self._segs[seg.name] = seg
        bisect.insort(self._bases, (seg.base, seg.name))
        off = seg.take(size)
        assert off == 0
        return seg, off

    def _collect_locked(self) -> None:
        """Return finalized allocations to their segments (tainted ones via quarantine); trim idle segments."""
        now = time.monotonic()
        while self._freed:
            name, off, size = self._freed.popleft()
            self._in_use -= size
            self._allocs -= 1
            seg = self._segs.get(name)
            if seg is None:
                continue
            hold = max((q for s, e, q in seg.taints if s < off + size and off < e), default=0.0)
            if hold > 0:
                seg.taints = [t for t in seg.taints if not (t[0] < off + size and off < t[1])]
                self._quarantine.append((now + hold, name, off, size))
            else:
                seg.give(off, size)
        if self._quarantine:
            keep = []
            for until, name, off, size in self._quarantine:
                seg = self._segs.get(name)
                if until > now:
                    keep.append((until, name, off, size))
                elif seg is not None:
                    seg.give(off, size)
            self._quarantine = keep
        total = sum(s.size for s in self._segs.values())
        for name in [n for n, s in self._segs.items() if s.idle]:
            if total <= self.keep_bytes:
                break
            seg = self._segs.pop(name)
            self._bases.remove((seg.base, name))
            total -= seg.size
            seg.destroy()

    # ------------------------------------------------------------------ lookup for recv()
    def locate(self, views: list[np.ndarray]) -> list[ShmRef | None]:
        """Where each flat uint8 view lies in the arena (None: empty, or not wholly inside one segment)."""
        if not self._bases:
            return [None] * len(views)
        out: list[ShmRef | None] = []
        with self._lock:
            for view in views:
                if view.nbytes == 0:
                    out.append(None)
                    continue
                ptr = view.ctypes.data
                i = bisect.bisect_right(self._bases, (ptr, "\uffff")) - 1
                if i < 0:
                    out.append(None)
                    continue
                base, name = self._bases[i]
                off = ptr - base
                out.append(ShmRef(name, off, view.nbytes) if off + view.nbytes <= self._segs[name].size else None)
        return out

    def taint(self, refs: list[ShmRef]) -> None:
        """Mark arena ranges of a region that ended without DONE: when freed they wait `quarantine_s`."""
        if self.quarantine_s <= 0:
            return
        with self._lock:
            for r in refs:
                seg = self._segs.get(r.name)
                if seg is not None:
                    seg.taints.append((r.offset, r.offset + r.nbytes, self.quarantine_s))

    # ------------------------------------------------------------------ fences
    @property
    def fence_name(self) -> str:
        return f"{self.tag}fence"

    def open_fence(self) -> tuple[int, int] | None:
        """A (word index, token) for a region that advertises arena slots; None when all words are taken."""
        with self._lock:
            if self._closed:
                return None
            if self._fence is None:
                self._fence_mm = _create_file(self.fence_name, FENCE_WORDS * 8)
                self._fence = np.frombuffer(self._fence_mm, dtype=np.int64)
                self._fence_free = list(range(FENCE_WORDS - 1, -1, -1))
            if not self._fence_free:
                return None
            idx = self._fence_free.pop()
            self._token += 1
            self._fence[idx] = self._token
            return idx, self._token

    def close_fence(self, idx: int) -> None:
        """Zero the region's word (senders stop before their next piece) and recycle it."""
        with self._lock:
            if self._fence is not None:
                self._fence[idx] = 0
                self._fence_free.append(idx)

    # ------------------------------------------------------------------ accounting / teardown
    def counts(self) -> tuple[int, int, int]:
        """(segments, live allocations, bytes in use) after draining pending frees."""
        with self._lock:
            self._collect_locked()
            return len(self._segs), self._allocs, self._in_use

    def shutdown(self) -> None:
        """Unlink every file. Live user arrays stay valid (their mapping outlives the file)."""
        with self._lock:
            self._closed = True
            for seg in self._segs.values():
                seg.destroy()
            self._segs.clear()
            self._bases.clear()
            self._quarantine.clear()
            if self._fence is not None:
                self._fence[:] = 0  # any sender still copying stops at its next piece
                self._fence = None
                try:
                    self._fence_mm.close()  # type: ignore[union-attr]
                except BufferError:
                    pass
                self._fence_mm = None
        self._finalizer()
