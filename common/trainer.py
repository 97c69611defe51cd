"""The core's torchtitan trainer: the recipe's own trainer class, extended the way torchtitan's extensions are
(a subclass with its `Config`, components built from their own `Config`), keeping the run's loss curve.

- `RecordingMetrics`: torchtitan's MetricsProcessor, which also keeps what it logs each step (loss, grad norm,
  tokens seen, the time): results.json holds these numbers, never scraped log lines.
- `recipe_trainer(base)`: `base` (torchtitan's `Trainer`, or the Transformers backend's `HFTransformerTrainer`) with
  a non-finite loss reported as one line instead of a traceback on every rank.
- `as_trainer_config(cls, tc)`: a recipe's `Trainer.Config` as `cls.Config`, the metrics recorded.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.components.metrics import MetricsProcessor

from common.losses import LossRecorder, not_finite


class RecordingMetrics(MetricsProcessor):
    """torchtitan's metrics processor (step lines, TensorBoard), keeping each logged step in `record`."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.record = LossRecorder()

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.record.add(int(step), float(global_avg_loss), float(grad_norm),
                        int((extra_metrics or {}).get("n_tokens_seen", 0)))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)


def recipe_trainer(config_class: type) -> type:
    """The trainer a recipe's Trainer.Config class builds (`config_class._owner`: torchtitan's Trainer, or the
    Transformers backend's HFTransformerTrainer for its TransformersBackendConfig) as the core runs it: its Config
    (`config_class` with every field it has) with the metrics recorded (`as_trainer_config`), its training timed
    from the start of `train`, and a non-finite loss one line."""
    base = config_class._owner

    class RecipeTrainer(base):
        @dataclass(kw_only=True, slots=True)
        class Config(config_class):
            pass

        def train(self):
            self.metrics_processor.record.start()
            try:
                return super().train()
            except RuntimeError as e:
                if (line := not_finite(e)) is None:
                    raise
                raise line from None

    RecipeTrainer.__name__ = RecipeTrainer.__qualname__ = f"Recipe{base.__name__}"
    return RecipeTrainer


def same_fields(cls, config, **changed):
    """`config` (a torchtitan Config) as an instance of `cls`, a subclass of its class: every field carried over."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return cls(**{**values, **changed})


def as_trainer_config(cls: type, tc, metrics=None):
    """The recipe's Trainer.Config `tc` as `cls.Config` (`cls`: a trainer class over the recipe's own), its metrics
    processor `metrics` (a RecordingMetrics.Config; default: the recipe's metrics settings, recorded)."""
    return same_fields(cls.Config, tc, metrics=metrics or same_fields(RecordingMetrics.Config, tc.metrics))
