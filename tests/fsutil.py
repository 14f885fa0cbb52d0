"""Helpers shared by the tests that exercise filesystem failures."""

import contextlib
import os


@contextlib.contextmanager
def unprivileged():
    """Root ignores directory permissions: drop the effective uid to nobody for the block (if root)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
