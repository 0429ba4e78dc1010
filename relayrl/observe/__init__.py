"""This package observes a run: stage timers, metrics sinks, a progress bar and run reports.

It imports torch's TensorBoard writer (lazily), tqdm, matplotlib (the report) and relayrl.errors only;
it must never import another relayrl layer: observe is a leaf, which the controller and the CLI import.
"""

from relayrl.observe.metrics import MetricsLogger, read_metrics, truncate_metrics
from relayrl.observe.progress import Progress
from relayrl.observe.timer import StageTimer

# report is not imported here: it pulls in matplotlib, which the training loop does not need.
__all__ = ["MetricsLogger", "Progress", "StageTimer", "read_metrics", "truncate_metrics"]
