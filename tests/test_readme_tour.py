"""A new user's path: the README tour's shell blocks marked "(run in CI)" run, in order, in one shell, and succeed.

The blocks run as the README shows them, in a fresh folder, with two changes: the port (8000 -> a free one) and the
``tetriinfer`` / ``python`` commands, which run this checkout with this interpreter. Blocks without the mark need a
second host or a second server and are not run. If this checkout's ``make-model`` cannot yet convert a GGUF file
(``--from-gguf``), that one command makes the tiny generated model under the same folder name instead, and the test
warns so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

from tetriinfer.net import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
MARK = "(run in CI)"
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def tour_blocks(readme: str) -> list[tuple[bool, str]]:
    """Every ```bash block of the README's tour, with whether the text since the previous block marks it run."""
    tour = readme.split("## A tour", 1)[1].split("\n## ", 1)[0]
    out, last = [], 0
    for m in FENCE.finditer(tour):
        out.append((MARK in tour[last:m.start()], m.group(1)))
        last = m.end()
    return out


def test_tour_blocks_are_found_and_marked() -> None:
    blocks = tour_blocks((ROOT / "README.md").read_text())
    run = [b for marked, b in blocks if marked]
    assert len(blocks) >= 9 and 6 <= len(run) < len(blocks)
    assert any("make-model --from-gguf" in b for b in run) and any("openai" in b for b in run)
    assert not any("ray start" in b or "--load-format fast-shm" in b for b in run)  # a second host / server


def _shims(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, target in (("tetriinfer", f'"{sys.executable}" -m tetriinfer.cli "$@"'),
                         ("python", f'"{sys.executable}" "$@"')):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\nexec {target}\n")
        shim.chmod(0o755)


def test_the_readme_tour_runs(tmp_path: Path) -> None:
    run = [b for marked, b in tour_blocks((ROOT / "README.md").read_text()) if marked]
    port = str(free_loopback_port())
    script = "\n".join(run).replace("8000", port)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TETRIINFER_CACHE": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    _shims(tmp_path / "bin")
    help_text = subprocess.run([sys.executable, "-m", "tetriinfer.cli", "make-model", "--help"], env=env,
                               capture_output=True, text=True, check=True).stdout
    if "--from-gguf" not in help_text:
        warnings.warn("make-model has no --from-gguf here: the tour ran on the tiny generated model", stacklevel=1)
        script = re.sub(r"make-model --from-gguf \S+", "make-model --arch llama --preset tiny", script)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "tour.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(["bash", "-c", "set -e\n" + script], cwd=work, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=480)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a block that hung, or a server a failed block left running
            except ProcessLookupError:
                pass
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    chat = next(line for line in out.splitlines() if line.startswith('{"id":"chatcmpl'))
    assert json.JSONDecoder().raw_decode(chat)[0]["choices"][0]["message"]["content"]
    summary = json.loads((work / "bench.json").read_text())["summary"]
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert "| mixed | tetriinfer |" in (work / "sim.md").read_text()
    assert "goodput" in (work / "placement.md").read_text().lower()
    assert re.search(r"GiB in \d+ partition", out)
