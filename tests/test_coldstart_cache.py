"""The cold-start cache is checksummed: a truncated, corrupted or unloadable entry is trained again with a warning;
a cache directory that cannot be written on a miss trains without caching."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fsutil import unprivileged
from test_coldstart import SingleDigitSum
from trainers.coldstart import CACHE_MANIFEST, cold_start, verify_cache_entry, write_cache_manifest
from trainers.config import ColdStartConfig, ModelConfig
from trainers.models import build_model
from trainers.tokenizer import build_char_tokenizer

torch.set_num_threads(1)

MODEL_CFG = ModelConfig(preset="tiny-dense")


def _run(cache: Path, **kw):
    tok = build_char_tokenizer()
    cfg = ColdStartConfig(steps=3, batch_size=8, cache_dir=str(cache))
    return cold_start(build_model(MODEL_CFG, len(tok), seed=0), tok, SingleDigitSum(), cfg, MODEL_CFG, seed=0,
                      eos_id=tok.eos_token_id, progress=False, **kw)


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(16 * 1024))


def _random_bytes_with_a_consistent_manifest(path: Path) -> None:
    _random_bytes(path)
    write_cache_manifest(str(path.parent))


def _no_manifest(path: Path) -> None:
    (path.parent / CACHE_MANIFEST).unlink()


@pytest.mark.parametrize("damage, why", [
    (_truncate, "model.safetensors does not match its checksum (truncated or corrupted)"),
    (_random_bytes, "model.safetensors does not match its checksum (truncated or corrupted)"),
    (_random_bytes_with_a_consistent_manifest, "its weights do not load: "),
    (_no_manifest, f"no {CACHE_MANIFEST}"),
])
def test_a_bad_cache_entry_is_trained_again_with_a_warning(tmp_path, caplog, damage, why):
    cache = tmp_path / "cache"
    first, info = _run(cache)
    entry = Path(info["model_dir"])
    assert verify_cache_entry(str(entry)) == (True, "checksums ok")
    damage(entry / "model.safetensors")
    caplog.clear()
    again, info2 = _run(cache)
    assert f"cold start: cached model {entry} is not usable ({why}" in caplog.text
    assert info2["coldstart/cached"] == 0.0 and info2["model_dir"] == str(entry)
    assert _same(first, again)  # retrained to the same weights (CPU, fixed seed) and cached again
    assert verify_cache_entry(str(entry))[0]
    _, info3 = _run(cache)
    assert info3["coldstart/cached"] == 1.0


def _run_in_a_process(cache: Path) -> tuple[str, float]:
    model, info = _run(cache)
    return info["model_dir"], sum(float(p.double().sum()) for p in model.state_dict().values())


def test_runs_that_cold_start_the_same_entry_at_once_all_get_a_verified_entry(tmp_path):
    # tune workers without a primed cache train the same entry side by side; an entry appears with its
    # manifest in one rename, so no run sees (or breaks) another's half-written entry
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    cache = tmp_path / "cache"
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_run_in_a_process, [cache] * 3))
    dirs, sums = {d for d, _ in results}, {s for _, s in results}
    assert len(dirs) == 1 and len(sums) == 1  # one entry, the same weights in every run
    assert verify_cache_entry(next(iter(dirs))) == (True, "checksums ok")
    assert [p.name for p in cache.iterdir()] == [Path(next(iter(dirs))).name]  # no temporary left
    model, info = _run(cache)
    assert info["coldstart/cached"] == 1.0


def test_an_unwritable_cache_directory_trains_without_caching(caplog):
    base = Path(tempfile.mkdtemp(prefix="dcmdp_ro_cache_"))  # outside pytest's root-only tmp tree
    try:
        base.chmod(0o755)
        cache, fallback = base / "cache", base / "fallback"
        cache.mkdir(mode=0o555)
        cache.chmod(0o555)
        fallback.mkdir()
        fallback.chmod(0o777)
        with unprivileged():
            model, info = _run(cache, fallback_dir=str(fallback / "model"))
        assert (f"cold start: the cache directory {cache} cannot be written (Permission denied): training 3 steps "
                f"without caching; the model is saved to {fallback / 'model'}") in caplog.text
        assert info["model_dir"] == str(fallback / "model") and info["coldstart/cached"] == 0.0
        assert (fallback / "model" / "model.safetensors").is_file()
        assert list(cache.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
