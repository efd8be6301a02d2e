"""Link units, pure (no I/O): bandwidths and durations as people write them, and named link presets.

Used by the transfer backends' link emulation (``transfer.paced``) and the simulator's links (``sim.link``).
"""

from __future__ import annotations

import re

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bps|b/s|bit/s|gbit|B/s|Bps|B)\s*$",
                    re.IGNORECASE)
_T_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)?\s*$")

LINK_PRESETS: dict[str, str] = {
    "roce-200g": "200Gbps",  # the paper's emulated RDMA NIC link
    "nvlink-300": "300GB/s",  # the paper's emulated NVLink
    "eth-10g": "10Gbps",
}


def parse_bandwidth(spec: str | float | int) -> float:
    """Bytes per second from '200Gbps' (bits), '300GB/s' or '300GBps' (bytes), '10gbit', or a number (bytes/s).

    A lowercase 'b' before 'ps'/'/s' means bits, an uppercase 'B' means bytes; 'Gbps' is always bits."""
    if isinstance(spec, int | float):
        value = float(spec)
    else:
        s = LINK_PRESETS.get(spec.strip().lower(), spec)
        match = _BW_RE.match(s)
        if not match:
            raise ValueError(f"cannot parse bandwidth {spec!r}; use e.g. '200Gbps', '300GB/s', '10Gbps'")
        number, prefix, unit = match.groups()
        is_bytes = unit.startswith("B")
        value = float(number) * _UNITS[prefix.lower()] / (1.0 if is_bytes else 8.0)
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0, got {spec!r}")
    return value


def parse_duration(spec: str | float | int) -> float:
    """Seconds from '5us', '1.5ms', '0.2s' or a number of seconds."""
    if isinstance(spec, int | float):
        value = float(spec)
    else:
        match = _T_RE.match(spec)
        if not match:
            raise ValueError(f"cannot parse duration {spec!r}; use e.g. '5us', '2ms', '0.1s'")
        number, unit = match.groups()
        value = float(number) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[unit]
    if value < 0:
        raise ValueError(f"duration must be >= 0, got {spec!r}")
    return value
