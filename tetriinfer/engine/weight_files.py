"""Which files of a local Hugging Face model folder hold its weights (no torch: file names only)."""

from __future__ import annotations

import json
from pathlib import Path


def weight_files(model_dir: Path) -> list[Path]:
    """The sharded safetensors named by ``model.safetensors.index.json``, else every ``*.safetensors``, else
    ``pytorch_model*.bin``; sorted. A folder with none, or an index naming a missing file, is an error."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"model folder {str(model_dir)!r} is missing weight files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if files:
        return files
    raise FileNotFoundError(
        f"model folder {str(model_dir)!r} has no weights (*.safetensors or pytorch_model*.bin); "
        "use load_format='dummy' for random weights"
    )
