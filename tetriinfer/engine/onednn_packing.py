"""Pre-packed oneDNN weights for the bf16 matmuls of CPUs with AMX.

torch's ``F.linear`` on a plain bf16 weight reorders that weight into oneDNN's blocked (VNNI) layout on every call:
on an AMX core that reorder costs more than the tile GEMM itself for decode batches. Packing each weight once at
load (``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's CPU freezing uses) and calling
``torch.ops.mkldnn._linear_pointwise`` on it removes that cost. Measured on one core of a 2-core Xeon with AMX
(SmolLM2-135M's 30 layers of decoder matmuls, weights cold in cache): 1.4-1.65x faster than ``F.linear`` from 1 to
64 rows, 1.2x at 512; the tied 49152-row LM head 2.6x faster at 48 rows (``benchmarks/bench_decode_kernels.py
--packed``). The outputs are bit-identical to ``F.linear``'s on the same inputs (the same oneDNN kernel runs).

Invariants:
- Packing happens only for bf16 models on CPU, on CPUs with AMX (which have the AVX-512 subsets oneDNN's bf16
  reorder needs), when torch was built with oneDNN and has the two
  ops, and unless ``TETRIINFER_ONEDNN_PACK=0``. fp32 is never packed: the native fp32 kernels match the packed
  path there (measured at parity from 1 to 64 rows).
- Every packed ``Linear`` computes all its matmuls on the packed weight, whatever the row count.
- A weight that no other parameter shares is freed after packing (its parameter keeps its name and becomes an
  empty tensor), so memory does not grow; a shared one (the LM head tied to the token embedding) stays, and the
  packed copy is extra (vocab x hidden).
- Packing is done once, after loading and before the first step; a packed model is not written back to
  checkpoints (``packed_linear_count`` tells callers it has been packed).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tetriinfer.engine.cpu_info import cpu_has_amx, onednn_bf16_packing_supported

# The batch size oneDNN is told when it picks the packed layout. One layout serves every row count: measured on an
# AMX core, layouts picked for 16, 64 and 256 rows ran decode matmuls of 1 and 48 rows within 2% of each other;
# a layout picked for 1 row was 29% slower at 48 rows.
PACK_HINT_ROWS = 64


def onednn_packing_available(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether `pack_linear_weights` would pack a ``dtype`` model on ``device`` here."""
    if os.environ.get("TETRIINFER_ONEDNN_PACK", "1") == "0":
        return False
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not cpu_has_amx():
        return False
    if not onednn_bf16_packing_supported():
        return False
    mkldnn_ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn_ops, "_reorder_linear_weight")
            and hasattr(mkldnn_ops, "_linear_pointwise"))


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[T, in] @ packed [out, in].T (+ [out]) -> [T, out], all bf16 on CPU."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def pack_linear_weights(model: nn.Module, dtype: torch.dtype, device: str | torch.device) -> int:
    """Pack the weight of every 2-D ``Linear`` of ``model`` that can run on a packed weight (the engine's
    ``tetriinfer.engine.models.layers.Linear``, known by its ``packed_weight`` slot) where
    `onednn_packing_available`; returns how many were packed (0: nothing changed)."""
    if not onednn_packing_available(dtype, device):
        return 0
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if (not isinstance(module, nn.Linear) or not hasattr(type(module), "packed_weight")
                    or module.packed_weight is not None):
                continue
            w = module.weight
            if w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu":
                continue
            shared = uses.get(w.data_ptr(), 0) > 1
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT_ROWS)
            if not shared:  # free the plain copy; the parameter keeps its name
                module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            count += 1
    model.packed_linear_count = count
    return count
