"""The training worker's MLflow logging: metrics that outlive a tracking-server outage,
and the machine's system metrics.

Lightning's MLFlowLogger sends each step's metrics at once and raises when the server does
not answer. This one collects them (each metric with its own step and time) and sends what
it holds at most every FLUSH_INTERVAL_S seconds, and at the end: one request a second
rather than one a step. What could not be sent is kept and sent with the next batch, so
a server that is down for a while loses nothing it comes back for; past MAX_PENDING
metrics the oldest are dropped. It warns once
per outage, and the run's final status is set if the server is back by then. The HTTP
client's retries are kept short (HTTP_RETRIES, HTTP_TIMEOUT_S) so that a step waits
seconds, not minutes, for a server that is down: the buffer does the retrying.
"""
import os
import re
import time
import warnings

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

MAX_PENDING = 100_000  # metrics kept while the server is unreachable
FLUSH_INTERVAL_S = 1.0  # the most often metrics are sent
BATCH_LIMIT = 1000  # metrics per log_batch call (MLflow's limit)
HTTP_RETRIES, HTTP_TIMEOUT_S = "1", "10"
NOT_METRICS = ("epoch",)  # Lightning adds the epoch to every log; the step says where a metric is
METRIC_NAME_DROP = re.compile(r"[^a-zA-Z0-9_/. -]+")  # characters MLflow refuses in names


def limit_http_retries() -> None:
    """Short MLflow HTTP retries for this process, unless the environment sets them."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_RETRIES)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)


class BufferedMLFlowLogger(MLFlowLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list = []  # mlflow.entities.Metric not yet sent, oldest first
        self._last_flush = 0.0  # time.monotonic() of the last attempt to send
        self._down_since: float | None = None
        self.last_error: Exception | None = None

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [
            Metric(key=METRIC_NAME_DROP.sub("", k), value=float(v), timestamp=now, step=step or 0)
            for k, v in metrics.items() if not isinstance(v, str) and k not in NOT_METRICS
        ]
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S or len(self.pending) >= BATCH_LIMIT:
            self.flush()

    def flush(self) -> bool:
        """Sends what is pending → whether everything went."""
        self._last_flush = time.monotonic()
        try:
            while self.pending:
                self.experiment.log_batch(run_id=self.run_id, metrics=self.pending[:BATCH_LIMIT])
                del self.pending[:BATCH_LIMIT]
        except Exception as e:  # any failure to reach the server: keep the metrics, go on
            del self.pending[: max(0, len(self.pending) - MAX_PENDING)]
            self.last_error = e
            if self._down_since is None:
                self._down_since = time.monotonic()
                warnings.warn(f"MLflow tracking server unreachable ({type(e).__name__}: {str(e)[:200]}); metrics are kept and sent when it answers")
            return False
        if self._down_since is not None:
            print(f"MLflow tracking server back after {time.monotonic() - self._down_since:.0f} s", flush=True)
            self._down_since = None
        return True

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self.flush():
            warnings.warn(
                f"MLflow tracking server unreachable at the end ({str(self.last_error)[:200]}): {len(self.pending)} metrics not sent"
            )
            return
        try:
            super().finalize(status)
        except Exception as e:
            warnings.warn(f"MLflow tracking server unreachable at the end ({type(e).__name__}): run status not set")


def start_system_metrics(tracking_uri: str, run_id: str, node: int | None = None):
    """MLflow's system-metrics monitor (CPU, memory, disk, network; GPU utilization and
    memory through NVML where there are GPUs) logging `system/...` into the run every
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds (10) from a background thread, as
    `system/node<N>/...` when `node` is given (one per node of a multi-node job). Returns
    the monitor (stop_system_metrics stops it), or None where psutil is missing."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, node_id=None if node is None else f"node{node}", tracking_uri=tracking_uri)
    except ImportError as e:
        warnings.warn(f"no system metrics: {e}")
        return None
    monitor.start()
    return monitor


def stop_system_metrics(monitor) -> None:
    """Stops the monitor and logs the samples taken since its last log, so that a run
    shorter than one logging interval has its system metrics too."""
    monitor.finish()
    try:
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as e:  # the server gone at the end: the metrics are not worth a failed run
        warnings.warn(f"last system metrics not logged ({type(e).__name__}: {str(e)[:200]})")
