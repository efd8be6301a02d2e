"""The real SmolLM2-135M-Instruct behind the OpenAI API: its own chat template, EOS ids, stop strings and
stop token ids, and greedy answers equal to transformers' generate token for token (in-process, colocated
and disaggregated serving)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.serve_helpers import ServeProcess
from tests.test_server_api import ServerThread
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.runtime.inprocess import InProcessEngineClient
from tetriinfer.server.app import build_app
from tetriinfer.server.chat_template import ChatTemplateError, render_chat, special_tokens_of

NAME = "smollm2-135m-instruct"
ENGINE_KW: dict[str, Any] = dict(chunk_size=128, num_kv_blocks=96, max_model_len=512, num_threads=1)
CAPITAL = "What is the capital of France?"
PROMPTS = (CAPITAL, "Name a color of the sky.", "Say hello in French.")


@pytest.fixture(scope="module")
def tok(smollm2: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


@pytest.fixture(scope="module")
def reference(smollm2: Path, tok: Any) -> dict[str, list[int]]:
    """transformers' greedy answer ids (EOS included when it stopped) to each prompt, at most 40 tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    out: dict[str, list[int]] = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = chat_ids(tok, [{"role": "user", "content": p}])
            gen = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
            out[p] = gen[0, len(ids):].tolist()
    return out


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"]) if not isinstance(ids, list) else ids


@pytest.fixture(scope="module")
def server(smollm2: Path) -> Iterator[ServerThread]:
    client = InProcessEngineClient(EngineConfig(model=str(smollm2), **ENGINE_KW), model_name=NAME)
    with ServerThread(build_app(client, served_model_name=NAME, api_key=None)) as srv:
        yield srv


def oai_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_matches_reference(oai: openai.OpenAI, tok: Any, reference: dict[str, list[int]],
                             prompts: tuple[str, ...] = PROMPTS) -> None:
    for prompt in prompts:
        ref = reference[prompt]
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=40, temperature=0)
        eos_end = ref[-1] == tok.eos_token_id
        assert r.choices[0].finish_reason == ("stop" if eos_end else "length"), prompt
        assert r.usage.completion_tokens == len(ref), prompt  # the EOS counts; nothing follows it
        assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True), prompt


def test_chat_template_renders_exactly_like_transformers(tok: Any) -> None:
    from tetriinfer.engine.make_model import CHAT_TEMPLATE

    conversations: list[list[dict[str, str]]] = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
         {"role": "user", "content": "Q2 — ünïcode"}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}],
    ]
    loops = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
             "{{ m['role'] | upper }}: {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
             "{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ messages[0] | tojson }}")
    for template in (tok.chat_template, CHAT_TEMPLATE, loops):
        for conv in conversations:
            for gen in (True, False):
                want = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, chat_template=template)
                assert render_chat(template, conv, add_generation_prompt=gen,
                                   special_tokens=special_tokens_of(tok)) == want
        want = tok.apply_chat_template(conversations[3], tokenize=False, continue_final_message=True,
                                       chat_template=template)
        assert render_chat(template, conversations[3], add_generation_prompt=False, continue_final_message=True,
                           special_tokens=special_tokens_of(tok)) == want
    with pytest.raises(ChatTemplateError, match="no system"):
        render_chat("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}",
                    conversations[1], add_generation_prompt=True)


def test_chat_equals_transformers_and_stops_at_eos(server: ServerThread, tok: Any,
                                                   reference: dict[str, list[int]]) -> None:
    oai = oai_of(server.url)
    assert_matches_reference(oai, tok, reference)
    assert tok.decode(reference[CAPITAL], skip_special_tokens=True) == "The capital of France is Paris."
    stream = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": CAPITAL}],
                                         max_tokens=40, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # ignore_eos: the EOS is just a token and the answer runs to max_tokens
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": CAPITAL}], max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 12)


def test_completions_stop_strings_cut_exactly_and_stop_token_ids(server: ServerThread, tok: Any) -> None:
    oai = oai_of(server.url)
    prompt = tok.apply_chat_template([{"role": "user", "content": CAPITAL}], tokenize=False, add_generation_prompt=True)
    full = oai.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
    assert (full.choices[0].text, full.choices[0].finish_reason) == ("The capital of France is Paris.", "stop")
    for stop, want in ((" Paris", "The capital of France is"), ("of Fr", "The capital "), ("s P", "The capital of France i")):
        for stream in (False, True):
            if stream:
                chunks = list(oai.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                     stop=[stop, "never"], stream=True))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                r = oai.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never"])
                text, finish = r.choices[0].text, [r.choices[0].finish_reason]
            assert (text, finish) == (want, ["stop"]), (stop, stream)
    paris = tok.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    r = oai.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                               extra_body={"stop_token_ids": paris})
    # as in vLLM, a stop token that is not a special token stays in the text; nothing follows it
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("The capital of France is Paris", "stop")
    assert (r.choices[0].model_extra or {}).get("stop_reason") == paris[0]
    assert r.usage.completion_tokens == 6


def test_every_generation_config_eos_id_ends_the_answer(smollm2: Path, tmp_path: Path, tok: Any) -> None:
    """A folder whose config.json names another EOS (id 0) and whose generation_config lists both: the answer
    still ends at <|im_end|> with finish_reason stop, as transformers' generate would."""
    folder = tmp_path / "m"
    folder.mkdir()
    for item in smollm2.iterdir():
        if item.name == "model.safetensors":
            os.symlink(item, folder / item.name)
        else:
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    client = InProcessEngineClient(EngineConfig(model=str(folder), **ENGINE_KW), model_name=NAME)
    with ServerThread(build_app(client, served_model_name=NAME, api_key=None)) as srv:
        oai = oai_of(srv.url)
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": CAPITAL}],
                                        max_tokens=40, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The capital of France is Paris.", "stop")
        assert r.usage.completion_tokens == 8
        r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": CAPITAL}], max_tokens=10,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 10)
    from tetriinfer import LLM, SamplingParams

    out = LLM(model=str(folder), **ENGINE_KW).generate(  # the offline API stops there too
        [{"prompt_token_ids": chat_ids(tok, [{"role": "user", "content": CAPITAL}])}],
        SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("The capital of France is Paris.", "stop", 8)


def test_served_answers_equal_transformers_in_colocated_and_disaggregated_modes(
    smollm2: Path, tok: Any, reference: dict[str, list[int]]
) -> None:
    for args in (("--mode", "colocated", "--instances", "1"),
                 ("--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1")):
        srv = ServeProcess(smollm2, "--served-model-name", NAME, "--max-model-len", "512", *args)
        try:
            assert_matches_reference(oai_of(srv.base_url), tok, reference, PROMPTS[:2])
            if "tetriinfer" in args:  # by default the shipped predictor predicts every request's length in-band
                assert srv.predictions(at_least=2) == 2
        finally:
            srv.stop()
