"""TetriInfer: disaggregated, length-aware LLM serving (Hu et al., "Inference without Interference").

Heavy modules (torch) load lazily, so ``import tetriinfer.core`` stays pure and cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tetriinfer.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tetriinfer.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tetriinfer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
