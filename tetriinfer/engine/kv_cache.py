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

    def read_blocks(self, block_ids: list[int], out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Copies of the given blocks, per layer K then V: 2 * num_layers tensors [n, bs, Hkv, D]; into ``out``
        (same shapes and dtype, e.g. shared-memory buffers a peer reads from) when given."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        if out is not None and len(out) != 2 * len(self.k):
            raise ValueError(f"expected {2 * len(self.k)} output tensors, got {len(out)}")
        copies = []
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            for j, cache in enumerate((k, v)):
                src = self.block_view(cache)
                if out is None:
                    copies.append(src.index_select(0, idx))
                else:
                    copies.append(torch.index_select(src, 0, idx, out=out[2 * i + j]))
        return copies

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Inverse of ``read_blocks``."""
        if len(data) != 2 * len(self.k):
            raise ValueError(f"expected {2 * len(self.k)} tensors, got {len(data)}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            self.block_view(k).index_copy_(0, idx, data[2 * i].to(k.device, k.dtype))
            self.block_view(v).index_copy_(0, idx, data[2 * i + 1].to(v.device, v.dtype))
