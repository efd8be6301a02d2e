"""A receiver that runs in a child process (spawn), for cross-process tests and benchmarks.

Protocol over multiprocessing queues (test harness only; transfer bytes never go through them): the child posts
`recv(f"{transfer_id}-{i}", buffers)` with zeroed buffers of the given sizes, puts the msgspec-encoded
RemoteRegion, waits for the transfer to end, puts (state value, per-buffer uint8 sums, seconds from first byte
to DONE, reason); this repeats `repeats` times; then it waits for any message on `q_in` before shutting down. Imports only numpy/zmq/msgspec (no torch) to start fast.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np


def child_receiver(kind: str, transfer_id: str, sizes: list[int], q_in: Any, q_out: Any,
                   limit_s: float = 60.0, repeats: int = 1) -> None:
    from tetriinfer.transfer.factory import make_backend

    b = make_backend(kind)
    try:
        for i in range(repeats):
            _receive_once(b, f"{transfer_id}-{i}", sizes, q_out, limit_s)
        q_in.get(timeout=limit_s)
    finally:
        b.shutdown()


def _receive_once(b: Any, transfer_id: str, sizes: list[int], q_out: Any, limit_s: float) -> None:
    dst = [np.zeros(n, np.uint8) for n in sizes]
    region = b.recv(transfer_id, dst, timeout_s=limit_s)
    q_out.put(msgspec.msgpack.encode(region))
    deadline = time.monotonic() + limit_s
    first = None
    while time.monotonic() < deadline:
        st = b.status(transfer_id)
        if first is None and st.bytes_done > 0:
            first = time.perf_counter()
        if st.state.terminal:
            break
        time.sleep(0.001)
    end = time.perf_counter()
    st = b.status(transfer_id)
    sums = [int(d.sum(dtype=np.uint64)) for d in dst]
    q_out.put((st.state.value, sums, end - (first or end), st.reason))
    b.release(transfer_id)
