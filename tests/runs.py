"""Reading a finished training run back from its MLflow store, for the tests."""

from __future__ import annotations


def metric_history(summary, key: str) -> list[float]:
    """The values of metric ``key`` of the run ``summary`` (a ``train`` result), in step order."""
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=summary.tracking_uri).get_metric_history(summary.run_id, key)
    return [m.value for m in sorted(hist, key=lambda m: m.step)]
