"""Publishing a finished model folder atomically, shared by every way of making a model.

Invariants: readers never see a half-written model (a staging folder is renamed into place, or, with
``force`` over a non-empty folder, each model file is replaced atomically); a user's unrelated files in
the destination are never deleted; published files get the usual umask-based permissions.
"""

from __future__ import annotations

import os
from pathlib import Path

STALE_FILE_PATTERNS: tuple[str, ...] = (
    "model-*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if is_nonempty_dir(out) and not force:
        raise ValueError(f"{out} is not empty; pass --force (force=True) to overwrite the model files in it")


def publish(staging: Path, out: Path, force: bool) -> None:
    """Move the finished ``staging`` folder to ``out``.

    A missing or empty ``out`` is replaced by one atomic rename. With ``force``, a non-empty ``out``
    gets each model file replaced atomically and stale weight/tokenizer files that a loader could
    prefer removed; other files in it are left alone (we never delete a user's unrelated files).
    """
    try:
        os.rename(staging, out)  # atomic; replaces an empty directory, fails on a non-empty one
        return
    except OSError:
        if not is_nonempty_dir(out) or not force:
            raise
    for pattern in STALE_FILE_PATTERNS:
        for stale in out.glob(pattern):
            if stale.is_file():
                stale.unlink()
    for item in sorted(staging.iterdir()):
        os.replace(item, out / item.name)
    staging.rmdir()


def _current_umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def make_readable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; give the model the usual umask-based permissions."""
    umask = _current_umask()
    folder.chmod(0o777 & ~umask)
    for item in folder.iterdir():
        item.chmod(0o666 & ~umask)
