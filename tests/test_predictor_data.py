"""Buckets, input formats, dataset building and the by-prompt split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.dataset import DatasetConfig, LengthDataset, build_dataset, split_of
from tetriinfer.predictor.model import default_base_model
from tetriinfer.predictor.records import read_records
from tetriinfer.predictor.target_tokenizer import count_tokens, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "predictor"
LLAMA = FIXTURES / "alpaca_llama3_8b_60.json"
GPT4 = FIXTURES / "alpaca_gpt4_60.json"
MINILM = default_base_model()


def test_bucket_spec_bounds_and_open_last_bucket() -> None:
    spec = BucketSpec.for_granularity(200, max_tokens=1000)
    assert spec.num_buckets == 6  # [0,200) ... [800,1000), [1000, inf)
    assert [spec.bucket_of(n) for n in (0, 199, 200, 999, 1000, 10**6)] == [0, 0, 1, 4, 5, 5]
    assert (spec.lower(1), spec.upper(1)) == (200, 400)
    assert spec.upper(5) is None and spec.lower(5) == 1000
    np.testing.assert_array_equal(spec.buckets_of([0, 450, 5000]), [0, 2, 5])
    with pytest.raises(ValueError, match="granularity"):
        BucketSpec.for_granularity(0)
    with pytest.raises(ValueError, match=">= 0"):
        spec.bucket_of(-1)


def test_coarsen_probs_preserves_mass_and_maps_buckets() -> None:
    fine = BucketSpec.for_granularity(100, 2048)
    coarse = fine.coarser(200)
    assert coarse.lower(coarse.num_buckets - 1) <= fine.lower(fine.num_buckets - 1)
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(fine.num_buckets), size=5)
    merged = fine.coarsen_probs(probs, coarse)
    np.testing.assert_allclose(merged.sum(1), 1.0)
    # fine buckets 2 and 3 ([200,300), [300,400)) form coarse bucket 1
    np.testing.assert_allclose(merged[:, 1], probs[:, 2] + probs[:, 3])
    # every length lands in the coarse bucket that contains its fine bucket
    mapping = fine.coarsen_map(coarse)
    for n in (0, 150, 399, 1234, 2099, 5000):
        assert mapping[fine.bucket_of(n)] == coarse.bucket_of(n)
    with pytest.raises(ValueError, match="multiple"):
        fine.coarser(150)
    with pytest.raises(ValueError, match="open-ended"):
        fine.coarsen_map(BucketSpec.for_granularity(200, 4096))


def test_read_records_accepts_the_three_formats(tmp_path: Path) -> None:
    alpaca = read_records(LLAMA)
    assert len(alpaca) == 60 and alpaca[0].response is not None and alpaca[0].generator
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"prompt": "hi", "response": "hello there"}\n\n{"prompt": "yo", "output_tokens": 7}\n')
    recs = read_records(jl)
    assert [(r.prompt, r.response, r.output_tokens) for r in recs] == [
        ("hi", "hello there", None),
        ("yo", None, 7),
    ]


@pytest.mark.parametrize(
    ("content", "exc", "match"),
    [
        ("", ValueError, "empty"),
        ("   \n", ValueError, "empty"),
        ("[]", ValueError, "no records"),
        (
            '{"prompt": "a", "output_tokens": 3}\n{"prompt": "b", "output_tok',
            ValueError,
            r"a\.jsonl:2: malformed",
        ),
        ('{"prompt": "a"}\n', ValueError, "missing response"),
        ('{"response": "a"}\n', ValueError, "missing or empty prompt"),
        ('{"prompt": "a", "output_tokens": -2}\n', ValueError, "non-negative"),
        ('[{"instruction": "a", "output": 3}]', ValueError, "missing response"),
        ("[1, 2]", ValueError, "expected a JSON object"),
    ],
)
def test_bad_data_files_raise_clear_errors(
    tmp_path: Path, content: str, exc: type[Exception], match: str
) -> None:
    f = tmp_path / "a.jsonl"
    f.write_text(content)
    with pytest.raises(exc, match=match):
        read_records(f)


def test_missing_data_file_and_tokenizer_raise_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data file not found"):
        read_records(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "no_tokenizer")


def test_build_dataset_counts_with_target_tokenizer_and_splits_by_prompt_across_files(tmp_path: Path) -> None:
    ds = build_dataset([LLAMA, GPT4], MINILM, DatasetConfig(granularity=200, val_fraction=0.25, seed=3))
    assert len(ds.rows) == 120
    # an instruction shared by both files lands in exactly one split
    splits_by_prompt: dict[str, set[str]] = {}
    for r in ds.rows:
        splits_by_prompt.setdefault(r.prompt, set()).add(r.split)
    assert len(splits_by_prompt) == 60
    assert all(len(s) == 1 for s in splits_by_prompt.values())
    n_val = sum(1 for s in splits_by_prompt.values() if s == {"val"})
    assert 5 <= n_val <= 25  # ~25% of 60 prompts
    # lengths are counted with the target tokenizer, without special tokens
    tok = load_tokenizer(MINILM)
    raw = json.loads(LLAMA.read_text())
    expected = count_tokens(tok, [r["output"] for r in raw[:5]])
    got = [r.output_tokens for r in ds.rows[:5]]
    assert got == expected
    assert all(r.bucket == ds.spec.bucket_of(r.output_tokens) for r in ds.rows)
    assert {r.source for r in ds.rows} == {LLAMA.name, GPT4.name}
    assert ds.target == "Meta-Llama-3-8B-Instruct+gpt4_1106_preview"


def test_dataset_save_load_roundtrip_and_meta(tmp_path: Path) -> None:
    ds = build_dataset([LLAMA], MINILM, DatasetConfig(granularity=100, seed=1))
    out = ds.save(tmp_path / "ds")
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["granularity"] == 100 and meta["num_buckets"] == ds.spec.num_buckets
    assert meta["target_tokenizer"]["fingerprint"] == ds.target_tokenizer.fingerprint
    assert meta["counts"]["train"]["rows"] + meta["counts"]["val"]["rows"] == 60
    assert sum(meta["counts"]["val"]["histogram"]) == meta["counts"]["val"]["rows"]
    back = LengthDataset.load(out)
    assert back.spec == ds.spec
    assert back.split("train") == ds.split("train") and back.split("val") == ds.split("val")
    # a tampered row (bucket inconsistent with its length) is rejected on load
    lines = (out / "train.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["bucket"] = row["bucket"] + 1
    (out / "train.jsonl").write_text("\n".join([json.dumps(row)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="does not match"):
        LengthDataset.load(out)


def test_split_depends_on_seed_and_prompt_only() -> None:
    prompts = [f"prompt number {i}" for i in range(400)]
    a = [split_of(p, 0, 0.2) for p in prompts]
    assert a == [split_of(p, 0, 0.2) for p in prompts]
    assert a != [split_of(p, 1, 0.2) for p in prompts]
    assert 0.12 < a.count("val") / len(a) < 0.28


def test_cli_build_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.cli import main

    rc = main(
        [
            "predictor",
            "build-dataset",
            "--input",
            str(LLAMA),
            str(GPT4),
            "--target-tokenizer",
            str(MINILM),
            "--granularity",
            "400",
            "--out",
            str(tmp_path / "ds"),
            "--limit",
            "20",
        ]
    )
    assert rc == 0
    meta = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert meta["granularity"] == 400
    assert meta["counts"]["train"]["rows"] + meta["counts"]["val"]["rows"] == 40
    assert "dataset" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc = main(
        [
            "predictor",
            "build-dataset",
            "--input",
            str(empty),
            "--target-tokenizer",
            str(MINILM),
            "--granularity",
            "200",
            "--out",
            str(tmp_path / "ds2"),
        ]
    )
    assert rc == 2
    assert "empty" in capsys.readouterr().err
