"""The hand-written reading of a results page: ``<name>_reading.md`` next to ``<name>.md``.

A benchmark regenerates its page from the measurements on every run; the reading of the numbers is written by
a person, so it lives in its own file and every benchmark appends it where the page says (``reading_lines``).
"""

from __future__ import annotations

from pathlib import Path


def reading_path(page: Path) -> Path:
    """``<name>_reading.md`` for the page ``<name>.md``."""
    return Path(page).with_name(Path(page).stem + "_reading.md")


def reading_lines(page: Path) -> list[str]:
    """A blank line and the reading's text, or nothing when the page has no reading yet."""
    path = reading_path(page)
    return ["", path.read_text().rstrip()] if path.exists() else []
