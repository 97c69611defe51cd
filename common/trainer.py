"""The core's torchtitan component: `RecordingMetrics`, torchtitan's MetricsProcessor keeping what it logs each step
(loss, grad norm, tokens seen, the time), so results.json holds these numbers, never scraped log lines. A recipe's
config names it as its `metrics` (`recorded`); the trainer stays the recipe's own (torchtitan's `Trainer`, or the
Transformers backend's `HFTransformerTrainer`), built by its Config's own `build()`.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.components.metrics import MetricsProcessor

from common.losses import LossRecorder


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


def same_fields(cls, config, **changed):
    """`config` (a torchtitan Config) as an instance of `cls`, a subclass of its class: every field carried over."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return cls(**{**values, **changed})


def recorded(tc) -> None:
    """The recipe's Trainer.Config with its metrics recorded: its own metrics settings, as RecordingMetrics'."""
    if not isinstance(tc.metrics, RecordingMetrics.Config):
        tc.metrics = same_fields(RecordingMetrics.Config, tc.metrics)
