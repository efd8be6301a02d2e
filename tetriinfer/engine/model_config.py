"""The engine's name for ``tetriinfer.model_config`` (model shapes parsed from ``config.json``).

The parsing lives below the engine so that the simulator, which must not import the engine, shares it.
"""

from tetriinfer.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]
