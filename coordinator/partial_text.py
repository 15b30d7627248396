"""Streamed text that may end in the first characters of a marker (a stop string, `<think>`,
`<tool_call>`): how much of it must be held back until the next piece says what it is."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `markers`.

    That end may still grow into the marker, so it must not be emitted yet; the rest of the
    text cannot be part of a marker that starts later.
    """
    markers = tuple(markers)
    longest = max((len(marker) - 1 for marker in markers), default=0)
    for size in range(min(longest, len(text)), 0, -1):
        tail = text[-size:]
        if any(marker.startswith(tail) for marker in markers):
            return size
    return 0


def split_at_partial_marker(text: str, markers: Iterable[str]) -> tuple[str, str]:
    """(what is safe to emit now, what to hold back)."""
    keep = partial_marker_length(text, markers)
    return text[: len(text) - keep], text[len(text) - keep :]
