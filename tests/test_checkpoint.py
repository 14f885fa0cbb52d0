"""Checkpoints on real files: exact resume, pruning, corruption, crashes, full disks, signals."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dcmdp.checkpoint import (CheckpointError, SignalCheckpointer, capture_rng, find_resume_checkpoint,
                              load_checkpoint, restore_rng, save_checkpoint, verify_checkpoint)
from dcmdp.dual import DualState
from fsutil import unprivileged

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 60.0


def _tiny(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 6))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> None:
    # The batch comes from the global torch RNG, so an unrestored RNG would also change the update.
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    loss = (model(x) - y).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def _draws() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(4), random.random(), np.random.rand(3)


def _small(step: int) -> dict:
    return {"step": step, "w": torch.full((256,), float(step))}


def _snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root (directories appear through their files)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_round_trip_resumes_bitwise_like_the_uninterrupted_run(tmp_path):
    random.seed(1)
    np.random.seed(1)
    model, optimizer, scheduler = _tiny(seed=1)
    for _ in range(3):
        _train_step(model, optimizer, scheduler)
    dual = DualState(lambda_C=torch.tensor([0.1, 0.25], dtype=torch.float64),
                     rule={"integral_C": [0.1, 0.3], "p_C": [1e-3, -2e-3], "cost_ema_C": [4e-3, 5e-3],
                           "cost_hist": [[0.001, 0.002], [0.004]]}, steps=3, skipped=1,
                     floor_C=torch.tensor([2e-3, float("nan")], dtype=torch.float64))
    history = [{"reward/mean": 0.25 * i, "dual/lambda/abs_prob_diff": 0.1 + i} for i in range(3)]
    payload = {"step": 3, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "scheduler": scheduler.state_dict(), "dual": dual.state_dict(), "engine_version": 3,
               "run_id": "0123abcd", "history": history, "rng": capture_rng()}
    path = save_checkpoint(tmp_path / "ckpt", 3, payload, keep=2)
    assert path == tmp_path / "ckpt" / "step_00000003"

    # The uninterrupted run goes on: three RNG streams, then one more optimiser step.
    expected_draws = _draws()
    _train_step(model, optimizer, scheduler)

    # A fresh process-like state: other weights, other RNG positions.
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    model2, optimizer2, scheduler2 = _tiny(seed=99)
    loaded = load_checkpoint(find_resume_checkpoint(tmp_path / "ckpt", "auto"))
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    scheduler2.load_state_dict(loaded["scheduler"])
    restore_rng(loaded["rng"])
    dual2 = DualState.from_state_dict(loaded["dual"])
    assert (loaded["step"], loaded["engine_version"], loaded["run_id"], loaded["history"]) == (3, 3, "0123abcd",
                                                                                                  history)
    assert dual2.lambda_C.dtype == torch.float64 and torch.equal(dual2.lambda_C, dual.lambda_C)
    assert torch.equal(dual2.floor_C[:1], dual.floor_C[:1]) and torch.isnan(dual2.floor_C[1])
    assert (dual2.rule, dual2.steps, dual2.skipped) == (dual.rule, dual.steps, dual.skipped)

    t, r, n = _draws()
    assert torch.equal(t, expected_draws[0])
    assert r == expected_draws[1]
    assert np.array_equal(n, expected_draws[2])
    _train_step(model2, optimizer2, scheduler2)
    for (k, p), p2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(p, p2), k
    for s, s2 in zip(optimizer.state.values(), optimizer2.state.values()):
        assert torch.equal(s["exp_avg"], s2["exp_avg"]) and torch.equal(s["exp_avg_sq"], s2["exp_avg_sq"])
        assert float(s["step"]) == float(s2["step"]) == 4.0
    # Warm-up over 6 scheduler steps: the 4th update ran at 1e-2 * 4/6, now 1e-2 * 5/6.
    assert scheduler2.last_epoch == scheduler.last_epoch == 4
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 5 / 6)


def test_keep_last_n_prunes_oldest_and_resaving_a_step_replaces_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in range(1, 6):
        save_checkpoint(ckpt, step, _small(step), keep=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004", "step_00000005"]
    save_checkpoint(ckpt, 6, _small(6), keep=3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004", "step_00000005", "step_00000006"]

    # Same step again: the new payload replaces the old one, no swap directory is left behind.
    save_checkpoint(ckpt, 6, {"step": 6, "w": torch.full((256,), -1.0)}, keep=3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000004", "step_00000005", "step_00000006"]
    assert float(load_checkpoint(ckpt / "step_00000006")["w"][0]) == -1.0

    # A lower step than the newest ones (resumed from an older checkpoint) is never pruned on its own save.
    save_checkpoint(ckpt, 2, _small(2), keep=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000006"]

    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(ckpt, 7, _small(7), keep=0)


def test_corrupt_and_partial_checkpoints_are_detected_and_auto_falls_back(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    for step in range(1, 5):
        save_checkpoint(ckpt, step, _small(step), keep=4)
    s1, s2, s3, s4 = (ckpt / f"step_{i:08d}" for i in range(1, 5))
    assert verify_checkpoint(s4)[0]

    # One flipped bit in the newest payload.
    state = s4 / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    ok, why = verify_checkpoint(s4)
    assert not ok and "sha256 mismatch" in why
    with caplog.at_level(logging.WARNING, logger="dcmdp.checkpoint"):
        assert find_resume_checkpoint(ckpt, "auto") == s3
    assert any(str(s4) in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)

    # Truncated payload, unreadable manifest, missing manifest (a partial copy).
    with open(s3 / "state.pt", "r+b") as f:
        f.truncate(100)
    (s2 / "manifest.json").write_text("{not json")
    (s1 / "manifest.json").unlink()
    assert "has 100 bytes" in verify_checkpoint(s3)[1]
    assert "unreadable manifest.json" in verify_checkpoint(s2)[1]
    assert "no manifest.json" in verify_checkpoint(s1)[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcmdp.checkpoint"):
        assert find_resume_checkpoint(ckpt, "auto") is None
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(str(p) in warned for p in (s1, s2, s3, s4))

    # An explicit path is verified too; the error names it and the reason.
    with pytest.raises(CheckpointError, match=f"{s4}.*sha256 mismatch"):
        find_resume_checkpoint(ckpt, str(s4))
    with pytest.raises(CheckpointError, match=f"{s3}.*has 100 bytes"):
        load_checkpoint(s3)
    with pytest.raises(CheckpointError, match=f"{ckpt / 'step_00000099'} does not exist"):
        find_resume_checkpoint(ckpt, str(ckpt / "step_00000099"))
    assert find_resume_checkpoint(ckpt, "") is None and find_resume_checkpoint(tmp_path / "none", "auto") is None
    save_checkpoint(ckpt, 5, _small(5), keep=4)
    assert find_resume_checkpoint(ckpt, str(ckpt / "step_00000005")) == ckpt / "step_00000005"


def test_crash_mid_write_leaves_a_temp_dir_that_is_ignored_then_cleaned(tmp_path):
    ckpt = tmp_path / "ckpt"
    # The child dies for real in the middle of writing state.pt: with SIGXFSZ at its default action (python
    # ignores it), the kernel kills the process when the file reaches RLIMIT_FSIZE.
    script = tmp_path / "crash.py"
    script.write_text(f"""
import resource, signal, torch
from dcmdp.checkpoint import save_checkpoint
save_checkpoint({str(ckpt)!r}, 1, {{"w": torch.ones(256)}}, keep=3)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
save_checkpoint({str(ckpt)!r}, 2, {{"w": torch.ones(100_000)}}, keep=3)
""")
    proc = subprocess.run([sys.executable, str(script)], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr
    names = sorted(p.name for p in ckpt.iterdir())
    assert names[0] == ".tmp-step_00000002-" + names[0].rsplit("-", 1)[1] and names[1:] == ["step_00000001"]
    leftover = ckpt / names[0]
    assert [p.name for p in leftover.iterdir()] == ["state.pt"]
    assert (leftover / "state.pt").stat().st_size == 64 * 1024  # cut off mid-write

    assert find_resume_checkpoint(ckpt, "auto") == ckpt / "step_00000001"
    save_checkpoint(ckpt, 3, _small(3), keep=3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001", "step_00000003"]


@contextlib.contextmanager
def _file_size_limit(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_write_failure_raises_and_leaves_existing_checkpoints_intact(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, 1, _small(1), keep=2)
    save_checkpoint(ckpt, 2, _small(2), keep=2)
    before = _snapshot(ckpt)
    # keep=1 would prune step 1 after a successful save: it must not happen after a failed one.
    with _file_size_limit(64 * 1024), pytest.raises(CheckpointError) as info:
        save_checkpoint(ckpt, 3, {"w": torch.ones(100_000)}, keep=1)
    message = str(info.value)
    assert str(ckpt) in message and "File too large" in message and "EFBIG" in message
    assert _snapshot(ckpt) == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001", "step_00000002"]
    assert verify_checkpoint(ckpt / "step_00000001")[0] and verify_checkpoint(ckpt / "step_00000002")[0]


def _can_mount_private_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            'mount -t tmpfs -o size=64k dcmdp_probe "$1"', "sh", str(where)],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_disk_full_on_a_real_small_filesystem(tmp_path):
    """A 256 KiB tmpfs in a private user+mount namespace (no root needed where user namespaces are allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _can_mount_private_tmpfs(mnt):
        pytest.skip("unprivileged user+mount namespaces are not available here")
    script = tmp_path / "full.py"
    script.write_text("""
import json, os, sys, torch
from dcmdp.checkpoint import CheckpointError, save_checkpoint, verify_checkpoint
d = sys.argv[1]
a = save_checkpoint(d, 1, {"w": torch.ones(1000)}, keep=3)
b = save_checkpoint(d, 2, {"w": torch.ones(1000)}, keep=3)
out = {"error": None}
try:
    save_checkpoint(d, 3, {"w": torch.ones(1_000_000)}, keep=1)
except CheckpointError as exc:
    out["error"] = str(exc)
out["after_failure"] = sorted(os.listdir(d))
out["verify"] = [verify_checkpoint(a), verify_checkpoint(b)]
save_checkpoint(d, 4, {"w": torch.ones(1000)}, keep=3)
out["after_retry"] = sorted(os.listdir(d))
print(json.dumps(out))
""")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           'mount -t tmpfs -o size=256k dcmdp_full "$1" && exec "$2" "$3" "$1"', "sh",
                           str(mnt), sys.executable, str(script)],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and "No space left on device" in out["error"] and str(mnt) in out["error"]
    assert out["after_failure"] == ["step_00000001", "step_00000002"]
    assert all(ok for ok, _ in out["verify"])
    assert out["after_retry"] == ["step_00000001", "step_00000002", "step_00000004"]


def test_unwritable_directory_raises_naming_it(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="dcmdp_ckpt_ro_"))
    try:
        base.chmod(0o755)
        ckpt = base / "ckpt"
        save_checkpoint(ckpt, 1, _small(1), keep=1)
        before = _snapshot(ckpt)
        ckpt.chmod(0o555)
        with unprivileged():
            with pytest.raises(CheckpointError, match=f"{ckpt} is not writable: Permission denied"):
                save_checkpoint(ckpt, 2, _small(2), keep=1)
            with pytest.raises(CheckpointError, match=f"cannot create checkpoint directory {ckpt / 'sub'}"):
                save_checkpoint(ckpt / "sub", 2, _small(2), keep=1)
        ckpt.chmod(0o755)
        assert _snapshot(ckpt) == before and verify_checkpoint(ckpt / "step_00000001")[0]
    finally:
        shutil.rmtree(base)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=f"cannot create checkpoint directory {blocker / 'ckpt'}"):
        save_checkpoint(blocker / "ckpt", 1, _small(1), keep=1)


def test_payload_must_be_plain_for_weights_only_loading(tmp_path):
    plain = {"od": collections.OrderedDict(a=1), "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
             "device": torch.device("cpu"), "bytes": b"ab", "set": {1, 2}, "complex": 1 + 2j, "none": None,
             "bool": True, "nan": float("nan"), "tuple_key": {(1, "a"): [1.5, "x"]},
             "param": torch.nn.Parameter(torch.ones(2)), "bf16": torch.ones(3, dtype=torch.bfloat16)}
    loaded = load_checkpoint(save_checkpoint(tmp_path / "ckpt", 1, plain, keep=1))
    assert set(loaded) == set(plain)
    for k in ("od", "size", "dtype", "device", "bytes", "set", "complex", "none", "bool", "tuple_key"):
        assert loaded[k] == plain[k] and type(loaded[k]) is type(plain[k]), k
    assert np.isnan(loaded["nan"]) and torch.equal(loaded["bf16"], plain["bf16"])

    dual = DualState(torch.zeros(1, dtype=torch.float64))
    for bad, where in (({"history": [{"a": 1.0}, {"b": np.float64(2.0)}]}, "payload['history'][1]['b']"),
                       ({"dual": dual}, "payload['dual']")):
        with pytest.raises(TypeError, match=re.escape(where)):
            save_checkpoint(tmp_path / "ckpt", 2, bad, keep=1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]


def test_signal_checkpointer_sets_a_flag_and_restores_the_previous_handlers():
    seen = []
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        with SignalCheckpointer() as stop:
            assert not stop.requested and stop.signal_name is None
            os.kill(os.getpid(), signal.SIGTERM)
            # a second signal while a checkpoint is written is counted, and stops the loop once the save ended
            with pytest.raises(KeyboardInterrupt, match="SIGINT"):
                with stop.hold():
                    os.kill(os.getpid(), signal.SIGINT)
                    deadline = time.monotonic() + 5
                    while stop.count < 2 and time.monotonic() < deadline:
                        time.sleep(0.001)
                    assert stop.count == 2
            assert (stop.requested, stop.signum, stop.signal_name, stop.count) == (True, signal.SIGTERM, "SIGTERM", 2)
        assert signal.getsignal(signal.SIGINT) is previous_int
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen == [signal.SIGTERM] and stop.count == 2
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited with {proc.returncode} before {path.name}:\n{proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"child did not reach {path.name} within {timeout} s")
        time.sleep(0.005)


def test_sigterm_makes_a_training_loop_save_and_exit_zero(tmp_path):
    ckpt, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "loop.py"
    script.write_text(f"""
import signal, time, torch
from pathlib import Path
from dcmdp.checkpoint import SignalCheckpointer, save_checkpoint
torch.manual_seed(0)
marks = Path({str(marks)!r})
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with SignalCheckpointer() as stop:
    step = 0
    while not stop.requested:
        step += 1
        loss = model(torch.randn(8, 64)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 3:
            (marks / "ready").touch()
        time.sleep(0.002)
    try:
        with stop.hold():
            (marks / "saving").touch()
            # 8 MB of extra state so the save takes a moment while the second signal arrives.
            save_checkpoint({str(ckpt)!r}, step, {{"step": step, "model": model.state_dict(), "optimizer":
                            optimizer.state_dict(), "extra": torch.zeros(2_000_000), "signal": stop.signal_name}}, keep=2)
            deadline = time.monotonic() + 20
            while stop.count < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            (marks / "count").write_text(str(stop.count))
    except KeyboardInterrupt:  # the second signal stops the loop, once the save has ended
        print("forced stop after the save")
print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
""")
    proc = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marks / "ready", proc, SUBPROCESS_TIMEOUT)
        os.kill(proc.pid, signal.SIGTERM)
        _wait_for(marks / "saving", proc, SUBPROCESS_TIMEOUT)
        os.kill(proc.pid, signal.SIGTERM)  # a second signal around the save: must not stop it
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "handler restored: True" in out and "forced stop after the save" in out
    assert (marks / "count").read_text() == "2"
    [path] = list(ckpt.iterdir())
    payload = load_checkpoint(path)
    assert path.name == f"step_{payload['step']:08d}" and payload["step"] >= 3
    assert payload["signal"] == "SIGTERM" and set(payload) == {"step", "model", "optimizer", "extra", "signal"}
