"""The default predictor's data: the shipped lengths of the default model, and prompts in their served form."""

from __future__ import annotations

import json
from pathlib import Path

from tetriinfer.predictor.default import (
    resolve_predictor,
    served_prompt_text,
    shipped_lengths_path,
    write_served_form,
)
from tetriinfer.server.chat_template import render_chat, special_tokens_of


def test_shipped_lengths_are_the_default_models_own(tmp_path: Path, smollm2: Path) -> None:
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in shipped_lengths_path().read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 60
    assert len({r["prompt"] for r in rows}) == len(rows)  # one line per instruction
    assert {r["model"] for r in rows} == {"smollm2-135m-instruct"}
    assert all(isinstance(r["output_tokens"], int) and 1 <= r["output_tokens"] <= 1024 for r in rows)
    assert all(r["finish_reason"] == "stop" or r["output_tokens"] == 1024 for r in rows)  # cut only at the cap

    # The text the predictor trains on is exactly what the serving hook decodes from a chat request's ids.
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    instruction = rows[0]["prompt"]
    served_ids = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": instruction}],
                                        add_generation_prompt=True, special_tokens=special_tokens_of(tok)),
                            add_special_tokens=False)
    assert served_prompt_text(tok, instruction) == tok.decode(served_ids, skip_special_tokens=True)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({**r, "response_text": "x"}) for r in rows[:3]) + "\n", encoding="utf-8")
    assert write_served_form(src, smollm2, tmp_path / "out.jsonl") == 3
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [o["output_tokens"] for o in out] == [r["output_tokens"] for r in rows[:3]]
    assert all("response_text" not in o and o["prompt"].startswith("system\n") for o in out)
    assert resolve_predictor("oracle") == "oracle" and resolve_predictor("/some/dir") == "/some/dir"
