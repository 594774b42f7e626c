"""The engine's run state, for the operator's endpoints: paused (vLLM's RLHF pause) and asleep.

- paused "abort": the open requests were ended (finish_reason "abort"); new ones are refused (503).
- paused "wait": running requests go on to their end; new ones wait in the queue until resume.
- paused "keep": nothing is scheduled; running requests keep their KV blocks and go on, exactly, at
  resume (a step in flight when the pause came is collected); new ones wait.
- asleep (level 1 or 2): the worker's weights and KV cache are out of its memory; new requests are
  refused (503) until every part is awake again. Sleep needs an engine with no open request.

Invariants: while frozen (paused "keep", or asleep) no step is scheduled; while paused "wait" no waiting
request is admitted; asleep implies no running request.
"""

from __future__ import annotations

from protocol.errors import InvalidParameterError

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags


class RunState:
    def __init__(self) -> None:
        self.paused = ""  # a PAUSE_MODES entry while paused
        self.sleeping: list[str] = []  # the SLEEP_TAGS parts asleep
        self.sleep_level = 0

    @property
    def frozen(self) -> bool:
        return self.paused == "keep" or bool(self.sleeping)

    @property
    def admits(self) -> bool:
        """Whether waiting requests may start running."""
        return not self.paused and not self.sleeping

    def check_new_request(self) -> None:
        """The 503 a new request gets now, if any (paused "wait" and "keep" queue it instead)."""
        if self.sleeping:
            raise InvalidParameterError(
                "model", "The engine is asleep; POST /wake_up wakes it.", code="engine_sleeping"
            )
        if self.paused == "abort":
            raise InvalidParameterError(
                "model", "The engine is paused (mode abort); POST /resume resumes it.", code="engine_paused"
            )

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidParameterError(
                "mode", f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}."
            )
        if self.sleeping:
            raise InvalidParameterError("mode", "The engine is asleep; wake it before pausing.")
        self.paused = mode

    def resume(self) -> None:
        self.paused = ""

    def sleep_tags(self, level: int) -> list[str]:
        if level not in (1, 2):
            raise InvalidParameterError("level", f"level must be 1 or 2, not {level!r}.")
        if self.sleeping:
            raise InvalidParameterError("level", "The engine is already asleep.")
        return list(SLEEP_TAGS)

    def wake_tags(self, tags: list[str] | None) -> list[str]:
        """The parts a wake_up with these tags wakes (None: all)."""
        unknown = sorted(set(tags or []) - set(SLEEP_TAGS))
        if unknown:
            raise InvalidParameterError("tags", f"unknown tags {unknown}; wake_up takes {list(SLEEP_TAGS)}.")
        return [tag for tag in self.sleeping if tags is None or tag in tags]
