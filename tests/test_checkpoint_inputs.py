"""Checkpoints and tracking buffers edited by mistake or on purpose: a pickle that would run code, a manifest naming
files outside its checkpoint, a resume path naming a file or a folder of checkpoints, a damaged progress file of a
buffer segment; and the stop signals that must always reach a run. No training here."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dcmdp.checkpoint import (CheckpointError, ForcedStop, SignalCheckpointer, find_resume_checkpoint, load_checkpoint,
                              save_checkpoint, verify_checkpoint)
from dcmdp.config import TrackingConfig
from dcmdp.tracking import Tracker, sync_report


def _rewrite_manifest(ckpt: Path, **change) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update(change)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dcmdp_pwned_by_checkpoint",))


def test_a_state_that_would_run_code_when_loaded_is_refused_and_runs_nothing(tmp_path):
    """An attacker who swaps state.pt and fixes the manifest's checksum: torch.load(weights_only=True) refuses the
    pickle's global, and the error names the checkpoint."""
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, {"step": 1}, keep=1)
    marker = Path("/tmp/dcmdp_pwned_by_checkpoint")
    marker.unlink(missing_ok=True)
    torch.save({"step": 1, "x": _RunsCode()}, ckpt / "state.pt")
    import hashlib

    data = (ckpt / "state.pt").read_bytes()
    _rewrite_manifest(ckpt, files={"state.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}})
    assert verify_checkpoint(ckpt)[0]
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} verified but could not be loaded"):
        load_checkpoint(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/../../x"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_invalid(tmp_path, name):
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, {"step": 1}, keep=1)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    ok, why = verify_checkpoint(ckpt)
    assert not ok and why == f"manifest.json names a file outside the checkpoint: {name!r}"


def test_a_resume_path_naming_a_file_or_a_folder_of_checkpoints_says_what_to_name(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt = save_checkpoint(ckpt_dir, 4, {"step": 4}, keep=1)
    with pytest.raises(CheckpointError, match=rf"is a file of a checkpoint: name its folder, "
                                              rf"checkpoint.resume={ckpt}$"):
        find_resume_checkpoint(ckpt_dir, str(ckpt / "state.pt"))
    with pytest.raises(CheckpointError, match=rf"is a folder of checkpoints, not one checkpoint: name one \(newest: "
                                              rf"{ckpt}\), or use checkpoint.resume=auto"):
        find_resume_checkpoint(ckpt_dir, str(ckpt_dir))


def test_a_damaged_progress_file_of_a_buffer_segment_is_reported_and_blocks_nothing_else(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    buffer_dir = tmp_path / "buffer"
    tracker = Tracker(TrackingConfig(uri=closed, buffer_dir=str(buffer_dir)), tmp_path)
    tracker.start({"p": "1"})
    tracker.log_metrics({"m": 1.0}, step=1)
    tracker.finish()
    [segment] = buffer_dir.glob("*.jsonl")
    sent = next(buffer_dir.glob("*.sent"))
    sent.write_bytes(b"\x00garbage")
    report = sync_report(buffer_dir, tracking_uri=f"sqlite:///{tmp_path / 'store.db'}")
    assert report.sent == 0
    assert report.remaining == [f"{segment}: its progress file {sent} (JSONDecodeError: Expecting value: line 1 "
                                f"column 1 (char 0)) is unreadable, so where sending stopped is unknown; delete that "
                                f"file to send the whole segment again (records sent before are then sent twice)"]
    sent.unlink()
    assert sync_report(buffer_dir, tracking_uri=f"sqlite:///{tmp_path / 'store.db'}").sent == 1


@pytest.mark.parametrize("first, second", [(None, signal.SIGQUIT), (signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGTERM)])
def test_a_sigquit_or_a_second_stop_signal_stops_at_once(first, second):
    """A first SIGINT/SIGTERM is a flag the loop polls at the end of a step; a step that never ends (a hung reward)
    must not make the run deaf: SIGQUIT, or a second signal, raises ForcedStop (a KeyboardInterrupt) where the code
    is, and the previous handlers come back."""
    previous = signal.getsignal(signal.SIGQUIT)
    with pytest.raises(ForcedStop) as err:
        with SignalCheckpointer() as stop:
            if first is not None:
                os.kill(os.getpid(), first)
                deadline = time.monotonic() + 5
                while not stop.requested and time.monotonic() < deadline:
                    time.sleep(0.001)
            os.kill(os.getpid(), second)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # a busy loop, as a hung step would be
                pass
    assert isinstance(err.value, KeyboardInterrupt) and err.value.signum == second
    assert signal.getsignal(signal.SIGQUIT) is previous
