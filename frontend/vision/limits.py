"""--limit-mm-per-prompt, read without the serving stack (the launcher checks it before anything starts)."""

from __future__ import annotations

import json

DEFAULT_LIMIT = 999  # vLLM's per modality


def parse_mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: '{"image": 2}' or '{"image": {"count": 2, ...}}' (vLLM's forms)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError("expected a JSON object, e.g. '{\"image\": 2}'")
    limits = {}
    for modality, value in values.items():
        if isinstance(value, dict) and set(value) - {"count"}:
            # vLLM's width, height, num_frames, length only size its memory profiling's dummy inputs
            raise ValueError(
                f"{modality}: {', '.join(sorted(set(value) - {'count'}))} not supported (only count)"
            )
        count = value.get("count", DEFAULT_LIMIT) if isinstance(value, dict) else value
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"{modality}: the count must be a non-negative integer, got {count!r}")
        if modality not in ("image", "video", "audio"):
            raise ValueError(f"unknown modality {modality!r}")
        if modality != "image" and count:
            raise ValueError(f"{modality}: this server takes images only (a {modality} limit may only be 0)")
        limits[modality] = count
    return limits
