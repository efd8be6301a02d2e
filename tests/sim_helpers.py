"""A small measured-looking cost profile shared by the simulator tests (seconds per prefill chunk and decode step)."""

from __future__ import annotations

from tetriinfer.sim.cost_model import ProfileCostModel

PROFILE = {
    "model": "test",
    "prefill": [{"tokens": 16, "seconds": 0.012}, {"tokens": 128, "seconds": 0.06}, {"tokens": 512, "seconds": 0.22},
                {"tokens": 1024, "seconds": 0.45}],
    "decode": [{"batch": 1, "seconds": 0.011}, {"batch": 4, "seconds": 0.0154}, {"batch": 16, "seconds": 0.0347},
               {"batch": 32, "seconds": 0.0469}],
}
COST = ProfileCostModel.from_profile(PROFILE)
