"""Run a batch file through an ASGI app: each line to its door, up to `max_concurrency` lines in flight
(so the engine batches them), the results written in the input's order as they become ready.

Invariants: every non-blank input line gives exactly one output line, at the same position among the
non-blank lines; a line that fails (bad JSON, a door's 400, an internal error) gives an error record, and
the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import IO, Any

import msgspec
from tqdm import tqdm

from frontend.batch.asgi import call_app
from frontend.batch.lines import BatchLine, LineError, answered, failed, parse_line

logger = logging.getLogger("engine.batch")


@dataclass
class Summary:
    num_lines: int = 0
    num_ok: int = 0  # answered with a 2xx
    num_errors: int = 0  # an error record (a door's 4xx/5xx, or a line no door took)


class OrderedWriter:
    """Writes record i once records 0..i-1 are written; holds the early ones until then."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.next_index = 0
        self.pending: dict[int, dict[str, Any]] = {}
        self.encoder = msgspec.json.Encoder()

    def add(self, index: int, record: dict[str, Any]) -> None:
        self.pending[index] = record
        while self.next_index in self.pending:
            self.out.write(self.encoder.encode(self.pending.pop(self.next_index)) + b"\n")
            self.next_index += 1
        if not self.pending:
            self.out.flush()  # a reader of the output sees every finished prefix


async def answer(app: Any, line: BatchLine) -> dict[str, Any]:
    """The output record of one line, from its door's answer."""
    try:
        response = await call_app(app, "POST", line.url, line.body, line.content_type)
    except Exception as error:  # the app failed without an answer: this line's error, not the run's
        logger.error("line %s: internal error", line.custom_id, exc_info=error)
        message = f"Internal error: {type(error).__name__}: {error}"
        return failed(
            line.custom_id, {"message": message, "type": "internal_error", "param": None, "code": None}
        )
    request_id = response.headers.get("x-request-id", "")
    return answered(line.custom_id, response.status, request_id, response.body)


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for text in f if text.strip())


async def run_batch(
    app: Any, input_path: str, output_path: str, max_concurrency: int, progress: bool
) -> Summary:
    summary = Summary()
    slots = asyncio.Semaphore(max_concurrency)
    tasks: set[asyncio.Task[None]] = set()
    seen: dict[str, int] = {}  # custom_id -> the line that first used it
    bar = tqdm(
        total=count_lines(input_path),
        unit="req",
        desc="run-batch",
        file=sys.stderr,
        disable=None if progress else True,  # None: shown only on a terminal
    )

    def record(writer: OrderedWriter, index: int, result: dict[str, Any]) -> None:
        if result["error"] is None:
            summary.num_ok += 1
        else:
            summary.num_errors += 1
        writer.add(index, result)
        bar.update()

    async def one(writer: OrderedWriter, index: int, line: BatchLine) -> None:
        try:
            result = await answer(app, line)
        finally:
            slots.release()
        record(writer, index, result)

    with open(input_path, encoding="utf-8", errors="replace") as source, open(output_path, "wb") as out, bar:
        writer = OrderedWriter(out)
        try:
            for number, text in enumerate(source, 1):
                if not text.strip():
                    continue
                index = summary.num_lines
                summary.num_lines += 1
                try:
                    line = parse_line(text, number)
                    if line.custom_id in seen:
                        raise LineError(
                            f"line {number}: custom_id {line.custom_id!r} is already used by line "
                            f"{seen[line.custom_id]}",
                            "duplicate_custom_id",
                            "custom_id",
                            line.custom_id,
                        )
                    seen[line.custom_id] = number
                except LineError as error:
                    record(writer, index, failed(error.custom_id, error.error()))
                    continue
                await slots.acquire()
                task = asyncio.create_task(one(writer, index, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # interrupted: the open lines' engine requests are aborted
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return summary
