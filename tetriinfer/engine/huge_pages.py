"""Model weights on transparent huge pages (2 MiB) on Linux CPUs.

A decode step streams every weight once. With 4 KiB pages the matmul kernels' software prefetches run ahead into
pages the TLB does not map yet, and every 4 KiB of weights costs a page walk: on one Zen 4 core, 30 cold
3072 x 576 bf16 matrices streamed at 18.9 GB/s at one row and 165 GFLOP/s at 48 rows from ordinary memory, and at
21.3 GB/s and 177 GFLOP/s from huge pages. Linux gives anonymous memory huge pages where ``madvise(MADV_HUGEPAGE)``
asks for them when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or
``always``; torch's CPU allocator does not ask.

`huge_page_buffer(nbytes)` is an anonymous mapping so advised, aligned to 2 MiB (a uint8 tensor that keeps its
mapping alive). `move_weights_to_huge_pages(model)` copies every CPU parameter that is not already in such a
buffer into one, keeping tied parameters tied (one copy per storage), and points the parameters at it.
`TETRIINFER_HUGE_PAGES=0` turns both off (the buffer is then ordinary memory; nothing is moved).

Invariants: values are copied bit for bit; parameters sharing storage before share it after; the parameter
objects stay the same (``param.data`` is replaced), so modules holding them see the move.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes between parameters in the buffer: every kernel's vector loads stay aligned as torch's allocator's
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Linux with transparent huge pages not set to ``never`` nor turned off for this process, mmap's
    MADV_HUGEPAGE known, and the switch on."""
    if os.environ.get("TETRIINFER_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        if "[never]" in THP_ENABLED.read_text():
            return False
        status = Path("/proc/self/status").read_text()  # "THP_enabled: 0": this process opted out (prctl)
    except OSError:
        return False
    return "THP_enabled:\t0" not in status


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor of ``nbytes``, 2 MiB aligned, on memory advised for huge pages (ordinary memory when
    `huge_pages_available` is False). The tensor keeps its mapping alive."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip: skip + nbytes]


def move_weights_to_huge_pages(model: torch.nn.Module) -> int:
    """Copy ``model``'s CPU parameters into one `huge_page_buffer` -> bytes moved (0 when huge pages are off or
    there is nothing to move). Parameters already in a huge-page buffer (``model.huge_page_ranges``) stay, and so
    does a model whose weights map memory shared with other processes (``model.shared_weight_mapping``: the
    ``fast-shm`` load format's one host copy)."""
    if not huge_pages_available() or getattr(model, "shared_weight_mapping", False):
        return 0
    ranges: list[tuple[int, int]] = getattr(model, "huge_page_ranges", [])
    by_storage: dict[int, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.device.type != "cpu" or not p.is_contiguous() or p.numel() == 0:
            continue
        start = p.data_ptr()
        if any(lo <= start < hi for lo, hi in ranges):
            continue
        by_storage.setdefault(start, []).append(p)
    if not by_storage:
        return 0
    sizes = {addr: ps[0].numel() * ps[0].element_size() for addr, ps in by_storage.items()}
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    buffer = huge_page_buffer(total)
    offset = 0
    for addr, params in by_storage.items():
        first = params[0]
        n = sizes[addr]
        view = buffer[offset: offset + n].view(first.dtype).view(first.shape)
        view.copy_(first.data)
        for p in params:  # tied parameters: one copy, every holder pointed at it
            p.data = view
        offset += -(-n // ALIGN) * ALIGN
    model.huge_page_ranges = [*ranges, (buffer.data_ptr(), buffer.data_ptr() + total)]
    log.debug("moved %d bytes of weights to huge pages", total)
    return total
