"""Observability: stage timers, metrics sinks, progress bar, and run reports."""

from relayrl.observe.metrics import MetricsLogger, read_metrics, truncate_metrics
from relayrl.observe.progress import Progress
from relayrl.observe.timer import StageTimer

# report is not imported here: it pulls in matplotlib, which the training loop does not need.
__all__ = ["MetricsLogger", "Progress", "StageTimer", "read_metrics", "truncate_metrics"]
