"""Payload normalization: every buffer that crosses a link becomes a flat, C-contiguous uint8 numpy view.

Invariant: `as_byte_view` never copies. Sources may be read-only; destinations must be writable. Torch CPU tensors
are accepted without importing torch here (any dtype, bfloat16 included, is reinterpreted as bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Buffer = Any  # numpy.ndarray or torch.Tensor (CPU, contiguous)


def _torch_to_numpy(t: Any) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"only CPU tensors can be sent by this backend, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous (pass the KV block view, not a strided slice)")
    import torch  # only reached when a torch tensor was passed

    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def as_byte_view(buf: Buffer, *, writable: bool = False) -> np.ndarray:
    """Zero-copy flat uint8 view of `buf`. Raises ValueError if that is impossible."""
    if isinstance(buf, np.ndarray):
        arr = buf
    elif type(buf).__module__.split(".")[0] == "torch":
        arr = _torch_to_numpy(buf)
    elif isinstance(buf, bytes | bytearray | memoryview):
        arr = np.frombuffer(buf, dtype=np.uint8)
    else:
        raise ValueError(f"unsupported buffer type {type(buf).__name__}; pass numpy arrays or torch tensors")
    if not arr.flags.c_contiguous:
        raise ValueError(f"buffer of shape {arr.shape} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("destination buffer is read-only")
    if arr.dtype == np.uint8 and arr.ndim == 1:
        return arr
    return arr.reshape(-1).view(np.uint8)


def as_byte_views(bufs: Sequence[Buffer], *, writable: bool = False) -> list[np.ndarray]:
    if isinstance(bufs, np.ndarray) or type(bufs).__module__.split(".")[0] == "torch":
        raise ValueError("pass a list of buffers, not a single array")
    return [as_byte_view(b, writable=writable) for b in bufs]


def plain_alloc(shape: Sequence[int], dtype: Any) -> Buffer:
    """Ordinary (non-shared) memory of `shape`: a torch tensor for a torch dtype, else a numpy array."""
    shape = tuple(int(s) for s in shape)
    if type(dtype).__module__.split(".")[0] == "torch":
        import torch

        return torch.empty(shape, dtype=dtype)
    return np.empty(shape, dtype=np.dtype(dtype))
