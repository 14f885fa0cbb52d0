"""Training an experiment's runs: long-lived worker processes (one torch thread each) that train the cell folders
they are sent, the cold starts warmed first, and each profile's training wall count."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from benchmarks._page import machine_kind, rel
from benchmarks.runner.records import MACHINE_FILE

ROOT = Path(__file__).resolve().parents[2]
# the command a worker process runs (``--serve``: see ``Worker``)
RUN_SCRIPT = ROOT / "benchmarks" / "run.py"
# per-step metrics kept in history.json (the checkpoint's history has every metric)
KEEP_PREFIXES = ("reward/", "eval/", "discrepancy/", "dual/", "penalty/", "policy/", "guard/", "loss/", "routing/",
                 "async/", "is/", "clip/", "time/", "throughput/", "rollout/", "task/", "response/")


def run_cell(out: Path) -> None:
    """Worker: train the run described by ``out/cell.json`` and write ``out/history.json``."""
    from dcmdp.config import load_config
    from dcmdp.loop import train

    if finished(out):  # finished meanwhile by another invocation on the same folder
        return
    spec = json.loads((out / "cell.json").read_text())
    if not (out / "summary.json").exists():
        train(load_config(spec["base"], spec["overrides"]))
    write_history(out)


def write_history(out: Path) -> None:
    """history.json from the final checkpoint (train() keeps the per-step history only there and in MLflow)."""
    from dcmdp.checkpoint import find_resume_checkpoint, load_checkpoint

    ckpt = find_resume_checkpoint(out / "checkpoints", "auto")
    if ckpt is None:
        raise FileNotFoundError(f"{out}: summary.json but no checkpoint to read the history from")
    kept = [{k: v for k, v in h.items() if k.startswith(KEEP_PREFIXES)} for h in load_checkpoint(ckpt)["history"]]
    tmp = out / "history.json.tmp"
    tmp.write_text(json.dumps(kept))
    tmp.replace(out / "history.json")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


class Worker:
    """A long-lived worker process (one torch thread) that trains the cells it is sent, one at a time.

    Importing torch / transformers / mlflow costs seconds per process, so cells share a process. Protocol:
    a cell folder per stdin line; the worker answers ``@@ok`` or ``@@fail`` on stdout (other stdout lines are
    ignored) and appends the run's log to ``<cell>/log.txt``.
    """

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    def run(self, out: Path) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            self.proc = subprocess.Popen([sys.executable, str(RUN_SCRIPT), "--serve"], cwd=ROOT,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=open(self.log_path, "a"), text=True, bufsize=1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{out}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line.strip() == "@@ok"
        return False  # the worker died; the next run starts a fresh one

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def note_machine(out: Path) -> None:
    """Add this machine's kind to the cell's ``MACHINE_FILE``."""
    path, here = out / MACHINE_FILE, machine_kind()
    kinds = path.read_text().strip().split(" then ") if path.exists() else []
    if not kinds or kinds[-1] != here:
        path.write_text(" then ".join([*kinds, here]) + "\n")


def serve() -> None:
    """Worker mode: train the cell folders read from stdin (see ``Worker``)."""
    import logging
    import traceback

    logging.basicConfig(level=logging.INFO)
    for line in sys.stdin:
        out = Path(line.strip())
        handler = logging.FileHandler(out / "log.txt")
        logging.getLogger().addHandler(handler)
        ok = False
        try:
            run_cell(out)
            note_machine(out)
            ok = True
        except Exception:  # a failed cell is reported and the matrix goes on
            logging.getLogger("benchmarks.run").error("run failed:\n%s", traceback.format_exc())
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        print("@@ok" if ok else "@@fail", flush=True)


def mlflow_template(bench_dir: Path) -> Path:
    """An empty MLflow sqlite store, created once: a fresh store runs its schema migrations (~5-20 s each)."""
    path = bench_dir / "mlflow_template.db"
    if not path.exists():
        from mlflow.tracking import MlflowClient

        tmp = bench_dir / "mlflow_template.tmp.db"
        tmp.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        tmp.replace(path)
    return path


def finished(out: Path) -> bool:
    return (out / "summary.json").exists() and (out / "history.json").exists()


def prepare(out: Path, base: Path, overrides: list[str], template: Path) -> bool:
    """Write the cell's spec (base config + dotlist); False when the cell already finished."""
    if finished(out):
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / "cell.json").write_text(json.dumps({"base": str(base), "overrides": overrides}, indent=1))
    if not (out / "mlflow.db").exists():
        shutil.copyfile(template, out / "mlflow.db")
    return True


def warm_cold_starts(base: Path, configs: list, workers: int = 1) -> None:
    """Train (or find cached) each distinct cold start once, before the runs' workers could race on it: the
    distinct ones (by their cache key: model, task, seed, hyper-parameters) on up to ``workers`` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from trainers.coldstart import cache_key, cold_start_for_run, verify_cache_entry
    from trainers.models import build_model
    from trainers.tasks import TASKS
    from trainers.tokenizer import build_char_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the key holds the thread count: computed as the worker (and the run) will train
    todo: dict[str, tuple[int, object]] = {}
    try:
        for seed, cfg in configs:
            if cfg.cold_start.steps == 0:
                continue
            cs_seed = seed if cfg.cold_start.seed is None else cfg.cold_start.seed
            tok = build_char_tokenizer()
            model = build_model(cfg.model, len(tok), seed=cs_seed)
            key = cache_key(model, tok, TASKS[cfg.task.name](cfg.task, seed), cfg.cold_start, cfg.model,
                            seed=cs_seed)
            if key not in todo and not verify_cache_entry(os.path.join(cfg.cold_start.cache_dir, key))[0]:
                todo[key] = (seed, cfg)
    finally:
        torch.set_num_threads(threads)
    if not todo:
        return
    print(f"{len(todo)} cold start(s) to train first, on {min(workers, len(todo))} process(es)", flush=True)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for path in pool.map(cold_start_for_run, *zip(*todo.values())):
            print(f"cold start ready: {rel(Path(path))}", flush=True)


# a wall count's key when it is a folder's total over every profile trained there (counted before walls were kept
# per profile)
SHARED_WALL = " (every profile in the folder)"


def train_missing(todo: list[Path], bench_dir: Path, workers: int, wall_file: Path) -> list[Path]:
    """Train the cells in ``todo`` on ``workers`` worker processes; the cells that failed. ``wall_file`` holds the
    profile's training wall seconds in ``bench_dir``, brought up to date as each cell ends (an invocation killed
    midway keeps its count up to its last finished cell)."""
    pool_workers: queue.Queue[Worker] = queue.Queue()
    for k in range(max(1, workers)):
        pool_workers.put(Worker(bench_dir / f"worker{k}.log"))

    def one(out: Path) -> tuple[Path, bool]:
        worker = pool_workers.get()
        try:
            return out, worker.run(out)
        finally:
            pool_workers.put(worker)

    t0, failed = time.perf_counter(), []
    earlier = float(wall_file.read_text()) if wall_file.exists() else 0.0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for i, fut in enumerate([pool.submit(one, out) for out in todo]):
            out, ok = fut.result()
            wall_file.write_text(f"{earlier + time.perf_counter() - t0:.1f}\n")
            if not ok:
                failed.append(out)
            print(f"[{i + 1}/{len(todo)}] {out.name}: {'done' if ok else 'FAILED, see ' + str(out / 'log.txt')} "
                  f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    while not pool_workers.empty():
        pool_workers.get().close()
    wall_file.write_text(f"{earlier + time.perf_counter() - t0:.1f}\n")
    return failed


# ------------------------------------------------------------------------------------------- analysis
