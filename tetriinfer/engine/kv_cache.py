"""The KV cache tensors of one engine: per layer, K and V of shape [num_blocks * block_size, Hkv, D].

Block accounting lives in ``tetriinfer.core.kv_cache_manager``; this file only owns memory.
"""

from __future__ import annotations

import torch

from tetriinfer.engine.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVCacheTensors:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        shape = (slots, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty: pages are committed lazily as blocks get used (a 2 GiB memset per engine start
        # would cost seconds). Never-written slots are never read: attention gathers only positions
        # below each request's length, and pads gathers with the request's own first slot.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v, strict=True))

    def block_view(self, tensor: torch.Tensor) -> torch.Tensor:
        # [slots, Hkv, D] -> [num_blocks, block_size, Hkv, D]
        return tensor.view(self.num_blocks, self.block_size, *tensor.shape[1:])

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of the given blocks, per layer K then V: 2 * num_layers tensors [n, bs, Hkv, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        out = []
        for k, v in zip(self.k, self.v, strict=True):
            out.append(self.block_view(k).index_select(0, idx))
            out.append(self.block_view(v).index_select(0, idx))
        return out

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Inverse of ``read_blocks``."""
        if len(data) != 2 * len(self.k):
            raise ValueError(f"expected {2 * len(self.k)} tensors, got {len(data)}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            self.block_view(k).index_copy_(0, idx, data[2 * i].to(k.device, k.dtype))
            self.block_view(v).index_copy_(0, idx, data[2 * i + 1].to(v.device, v.dtype))
