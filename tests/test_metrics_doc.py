"""Every metric name a training run emits is documented in the table of docs/metrics.md.

One short tiny-moe run (so routing/ metrics appear) with routing replay, the PID dual rule and two
constraints on the same measure (names `<measure>_1`, `<measure>_2`), plus eval_every=1; the names
come from the MLflow run itself (every key it holds) and from the loop's per-step history.
"""

import re
from pathlib import Path

import torch

from dcmdp.config import load_config
from dcmdp.loop import train

METRICS_DOC = Path(__file__).parents[1] / "docs" / "metrics.md"


def documented_patterns() -> list[re.Pattern]:
    """First-column names of the table in docs/metrics.md; `<x>` stands for one path segment."""
    names = re.findall(r"^\| `([^`]+)` \|", METRICS_DOC.read_text(), flags=re.M)
    assert len(names) > 20, "the Metrics table is missing or unreadable"
    return [re.compile("^" + re.sub(r"<[^>]+>", "[^/]+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">"))
                       + "$") for n in names]


def test_patterns_match_names_with_placeholders():
    pats = documented_patterns()
    assert any(p.match("dual/lambda/kl_k3_2") for p in pats)
    assert not any(p.match("dual/lambda/a/b") for p in pats)
    assert not any(p.match("reward/made_up") for p in pats)


def test_every_emitted_metric_is_documented(tmp_path):
    from mlflow.tracking import MlflowClient

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "model.preset=tiny-moe", "rollout.precision=int8", "cold_start.steps=5",
        f"cold_start.cache_dir={tmp_path / 'cache'}", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
        "algo.routing_replay=r3", "dual.rule=pid", "eval_every=1", "task.eval_size=8", "steps=2", "threads=1",
        "progress=false", f"output_dir={tmp_path / 'run'}",
        "dual.constraints=[{measure: kl_k3, tolerance: 1e-6}, {measure: kl_k3, tolerance: 1e-3}]"])
    summary = train(cfg)
    run = MlflowClient(tracking_uri=summary.tracking_uri).get_run(summary.run_id)
    emitted = set(run.data.metrics)
    assert {"dual/lambda/kl_k3_1", "dual/lambda/kl_k3_2", "routing/mismatch", "eval/accuracy"} <= emitted
    pats = documented_patterns()
    missing = sorted(k for k in emitted if not any(p.match(k) for p in pats))
    assert not missing, f"metrics emitted but not in docs/metrics.md: {missing}"
