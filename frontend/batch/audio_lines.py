"""A batch line for the audio doors: its JSON body becomes the multipart form the door reads, with `file`
given as a path on this machine or a data URL (`data:audio/wav;base64,...`)."""

from __future__ import annotations

import base64
import binascii
import os
import uuid
from typing import Any

AUDIO_DOORS = {"/v1/audio/transcriptions": "transcriptions", "/v1/audio/translations": "translations"}


class AudioLineError(ValueError):
    """The line's `file` cannot be read: (message, param)."""


def read_file_field(value: Any) -> tuple[str, bytes]:
    """`file` -> (a file name, its bytes)."""
    if not isinstance(value, str) or not value:
        raise AudioLineError("body.file must be a path or a data URL (data:audio/...;base64,...)")
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64"):
            raise AudioLineError("body.file: a data URL must be base64 (data:audio/...;base64,...)")
        try:
            return "audio", base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise AudioLineError("body.file: the data URL's base64 does not decode") from None
    if not os.path.isfile(value):
        raise AudioLineError(f"body.file: no such file {value!r}")
    with open(value, "rb") as f:
        return os.path.basename(value), f.read()


def multipart_body(body: dict[str, Any]) -> tuple[str, bytes]:
    """The line's body as multipart/form-data: (content type, bytes). Lists become repeated `name[]`
    fields, booleans true or false, as OpenAI's SDK sends them."""
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []

    def part(name: str, value: bytes, filename: str | None = None) -> None:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
        head += "Content-Type: application/octet-stream\r\n" if filename else ""
        parts.append(head.encode() + b"\r\n" + value + b"\r\n")

    filename, data = read_file_field(body.get("file"))
    part("file", data, filename.replace('"', "_"))
    for name, value in body.items():
        if name == "file":
            continue
        for item in value if isinstance(value, list) else [value]:
            text = ("true" if item else "false") if isinstance(item, bool) else str(item)
            part(f"{name}[]" if isinstance(value, list) else name, text.encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()
