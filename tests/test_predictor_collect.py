"""--collect-from against a fake OpenAI-compatible server started in the test."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tetriinfer.predictor.collect import CollectConfig, collect_lengths, done_prompts
from tetriinfer.predictor.model import default_base_model

MINILM = default_base_model()


def fake_length(prompt: str) -> int:
    return 37 * len(prompt.split()) + 5


class FakeServer:
    """Answers /v1/completions and /v1/chat/completions; fails prompts listed in ``fail`` with HTTP 500."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, object]]] = []
        self.fail: set[str] = set()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/chat/completions":
                    prompt = body["messages"][0]["content"]
                    choice: dict[str, object] = {"message": {"role": "assistant", "content": "ok"}}
                elif self.path == "/v1/completions":
                    prompt = body["prompt"]
                    choice = {"text": "ok"}
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                with outer.lock:
                    outer.requests.append((self.path, body))
                    failing = prompt in outer.fail
                if failing:
                    self.send_response(500)
                    self.end_headers()
                    return
                n = min(fake_length(prompt), int(body["max_tokens"]))
                choice["finish_reason"] = "stop"
                data = json.dumps(
                    {"choices": [choice], "usage": {"completion_tokens": n, "prompt_tokens": 3}}
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.close()


PROMPTS = [f"prompt {i} " + "word " * i for i in range(12)]


def test_collect_is_concurrent_resumable_and_skips_done(tmp_path: Path, server: FakeServer) -> None:
    out = tmp_path / "collected.jsonl"
    server.fail = {PROMPTS[3], PROMPTS[7]}
    cfg = CollectConfig(url=server.url, model="fake", concurrency=4, max_tokens=400, retries=1)
    res = collect_lengths(PROMPTS + PROMPTS[:2], out, cfg, show_progress=False)  # duplicates sent once
    assert (res.requested, res.skipped_done, res.collected, res.failed) == (12, 0, 10, 2)
    assert len(server.requests) == 10 + 2 * 2  # failures retried once
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["prompt"]: r["output_tokens"] for r in rows} == {
        p: min(fake_length(p), 400) for p in PROMPTS if p not in server.fail
    }
    assert all(body["max_tokens"] == 400 and body["model"] == "fake" for _, body in server.requests)

    # resume: only the two failed prompts are sent again
    server.fail = set()
    server.requests.clear()
    res = collect_lengths(PROMPTS, out, cfg, show_progress=False)
    assert (res.skipped_done, res.collected, res.failed) == (10, 2, 0)
    assert sorted(b["prompt"] for _, b in server.requests) == sorted([PROMPTS[3], PROMPTS[7]])
    assert done_prompts(out) == set(PROMPTS)
    assert len(out.read_text().splitlines()) == 12


def test_torn_last_line_is_repaired_on_resume(tmp_path: Path, server: FakeServer) -> None:
    out = tmp_path / "collected.jsonl"
    out.write_text(json.dumps({"prompt": PROMPTS[0], "output_tokens": 3}) + "\n" + '{"prompt": "prompt 1 wo')
    assert done_prompts(out) == {PROMPTS[0]}
    cfg = CollectConfig(url=server.url + "/v1", model="fake", chat=True)
    res = collect_lengths(PROMPTS[:3], out, cfg, show_progress=False)
    assert (res.skipped_done, res.collected) == (1, 2)
    assert all(path == "/v1/chat/completions" for path, _ in server.requests)
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)


def test_sampled_collection_sends_a_seed_per_prompt_that_a_rerun_repeats(tmp_path: Path, server: FakeServer) -> None:
    cfg = CollectConfig(url=server.url, model="fake", chat=True, temperature=0.7, sample_seed=5)
    collect_lengths(PROMPTS[:6], tmp_path / "a.jsonl", cfg, show_progress=False)
    first = {b["messages"][0]["content"]: b["seed"] for _, b in server.requests}
    assert all(b["temperature"] == 0.7 for _, b in server.requests)
    assert len(set(first.values())) == 6  # one seed per prompt, not one for the run
    rows = {json.loads(line)["prompt"]: json.loads(line)["seed"] for line in (tmp_path / "a.jsonl").read_text().splitlines()}
    assert rows == first  # the record says which seed drew the answer
    server.requests.clear()
    collect_lengths(list(reversed(PROMPTS[:6])), tmp_path / "b.jsonl", cfg, show_progress=False)
    assert {b["messages"][0]["content"]: b["seed"] for _, b in server.requests} == first  # order does not matter
    server.requests.clear()
    other = CollectConfig(url=server.url, model="fake", chat=True, temperature=0.7, sample_seed=6)
    collect_lengths(PROMPTS[:6], tmp_path / "c.jsonl", other, show_progress=False)
    assert {b["messages"][0]["content"]: b["seed"] for _, b in server.requests} != first
    server.requests.clear()
    greedy = CollectConfig(url=server.url, model="fake", chat=True, sample_seed=5)  # temperature 0: no seed sent
    collect_lengths(PROMPTS[:2], tmp_path / "d.jsonl", greedy, show_progress=False)
    assert all("seed" not in b for _, b in server.requests)


def test_collect_config_validation() -> None:
    with pytest.raises(ValueError, match="http"):
        CollectConfig(url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="--model"):
        CollectConfig(url="http://x", model="")
    with pytest.raises(ValueError, match="concurrency"):
        CollectConfig(url="http://x", model="m", concurrency=0)
    assert CollectConfig(url="http://x:1/", model="m").endpoint == "http://x:1/v1/completions"
    assert CollectConfig(url="http://x:1/v1/completions", model="m", chat=True).endpoint == (
        "http://x:1/v1/chat/completions"
    )


def test_cli_build_dataset_collect_from(
    tmp_path: Path, server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from tetriinfer.cli import main

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    argv = [
        "predictor",
        "build-dataset",
        "--input",
        str(prompts_file),
        "--target-tokenizer",
        str(MINILM),
        "--granularity",
        "100",
        "--out",
        str(tmp_path / "ds"),
        "--collect-from",
        server.url,
        "--model",
        "fake-model",
        "--concurrency",
        "3",
        "--max-tokens",
        "1000",
    ]
    assert main(argv) == 0
    meta = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert meta["target"] == "fake-model"
    rows = [
        json.loads(line)
        for s in ("train", "val")
        for line in (tmp_path / "ds" / f"{s}.jsonl").read_text().splitlines()
    ]
    assert {r["prompt"]: r["output_tokens"] for r in rows} == {p: fake_length(p) for p in PROMPTS}
    assert all(r["bucket"] == min(r["output_tokens"] // 100, meta["num_buckets"] - 1) for r in rows)
    # rerunning resumes: nothing is sent again
    n_before = len(server.requests)
    assert main(argv) == 0
    assert len(server.requests) == n_before
    assert "12 already done" in capsys.readouterr().out
