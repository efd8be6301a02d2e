"""Pre-packed oneDNN weights for bf16 matmuls (engine/onednn_packing.py): same numbers as ``F.linear``, memory
not grown, the switch and the dtype / CPU conditions honoured. The AMX condition is a routing policy: these tests
pretend to be on an AMX CPU so that they run on any CPU where oneDNN's bf16 reorder runs (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT); on others (AVX2 only) torch refuses the packed op, so the packing tests skip and the policy test
checks that nothing is packed there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tetriinfer.engine import onednn_packing
from tetriinfer.engine.cpu_info import onednn_bf16_packing_supported
from tetriinfer.engine.loader import load_model
from tetriinfer.engine.models.layers import Linear
from tetriinfer.engine.onednn_packing import onednn_packing_available, pack_linear_weights

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture
def amx(monkeypatch: pytest.MonkeyPatch) -> None:
    if not onednn_bf16_packing_supported():
        pytest.skip("no AVX-512 BW/VL/DQ or AVX-NE-CONVERT: oneDNN's bf16 reorder cannot run on this CPU")
    monkeypatch.setattr(onednn_packing, "cpu_has_amx", lambda: True)
    monkeypatch.delenv("TETRIINFER_ONEDNN_PACK", raising=False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 48, 300])
def test_a_packed_linear_gives_f_linear_s_bits_at_every_row_count(amx: None, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(576, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 576, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    want = F.linear(x, layer.weight, layer.bias)
    model = torch.nn.Sequential(layer)
    with torch.inference_mode():
        assert pack_linear_weights(model, torch.bfloat16, "cpu") == 1
        got = layer(x)
        assert layer.weight.numel() == 0  # the plain copy is freed
        assert torch.equal(got, want)
        assert torch.equal(layer(x[None]), want[None])  # leading dims kept


def test_packing_keeps_a_tied_lm_head_s_embedding_and_the_model_s_answers(amx: None, tiny_llama: Path,
                                                                        tmp_path: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model, cfg = load_model(tmp_path, "bfloat16", load_format="dummy")
    assert cfg.tie_word_embeddings
    ids = torch.arange(3, 40)
    with torch.inference_mode():
        want = F.linear(model.embed_tokens(ids), model.lm_head.weight)  # the packed path runs F.linear's kernel
        n = pack_linear_weights(model, torch.bfloat16, "cpu")
        assert n in (1 + 4 * cfg.num_layers, 1 + 7 * cfg.num_layers)
        assert model.packed_linear_count == n
        assert model.embed_tokens.weight.shape == (cfg.vocab_size, cfg.hidden_size)  # still used for lookups
        assert model.lm_head.weight is model.embed_tokens.weight
        assert torch.equal(model.lm_head(model.embed_tokens(ids)), want)
        assert all(m.weight.numel() == 0 for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
        assert pack_linear_weights(model, torch.bfloat16, "cpu") == 0  # once only


def test_packing_is_off_for_fp32_without_amx_or_the_bf16_reorder_and_when_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn_packing, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(onednn_packing, "onednn_bf16_packing_supported", lambda: False)
    assert not onednn_packing_available(torch.bfloat16, "cpu")  # an AVX2-only CPU: torch would refuse the reorder
    monkeypatch.setattr(onednn_packing, "onednn_bf16_packing_supported", lambda: True)
    monkeypatch.delenv("TETRIINFER_ONEDNN_PACK", raising=False)
    assert onednn_packing_available(torch.bfloat16, "cpu")
    assert not onednn_packing_available(torch.float32, "cpu")
    assert not onednn_packing_available(torch.bfloat16, "meta")
    monkeypatch.setenv("TETRIINFER_ONEDNN_PACK", "0")
    assert not onednn_packing_available(torch.bfloat16, "cpu")
    model = torch.nn.Sequential(Linear(8, 8).to(torch.bfloat16))
    assert pack_linear_weights(model, torch.bfloat16, "cpu") == 0 and model[0].packed_weight is None
    monkeypatch.setenv("TETRIINFER_ONEDNN_PACK", "1")
    monkeypatch.setattr(onednn_packing, "cpu_has_amx", lambda: False)
    assert not onednn_packing_available(torch.bfloat16, "cpu")
