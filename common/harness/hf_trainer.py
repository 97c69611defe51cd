"""The guards' trainer for the Transformers backend: its `HFTransformerTrainer` with GuardedLoop, the twin of
common/harness/trainer.py's GuardedTrainer (a module of its own: the backend imports transformers).

Import only after `common.device.setup()` (torchtitan binds its device at import time).
"""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan.experiments.transformers_modeling_backend.configs import TransformersBackendConfig
from torchtitan.experiments.transformers_modeling_backend.trainer import HFTransformerTrainer

from common.harness.trainer import GuardedLoop


class GuardedHFTrainer(GuardedLoop, HFTransformerTrainer):
    """The Transformers backend's trainer with the guards (GuardedLoop)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformersBackendConfig):
        pass
