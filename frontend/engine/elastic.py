"""Elastic data parallel, the launcher's side (docs/parallel.md): grow or shrink the engines this
`engine serve --enable-elastic-ep` runs while it serves. The API servers ask through the launcher's
control socket (POST /scale_elastic_ep); engine 0 tells every frontend, attached ones included, who the
engines are (EngineSet), so each connects to new engines and drops leaving ones.

A scale, in order:
1. engine 0 says the set is changing: every frontend answers new requests 503 (Retry-After) meanwhile;
   requests already running go on.
2. Growing: the new engines start; each must register (its model loaded) within the timeout, or the
   scale fails: they are stopped and the old set serves on. Shrinking: the leaving engines (the highest
   ranks) finish their requests within drain_timeout; what is left then ends (finish_reason "abort").
3. engine 0 gives the new set: frontends join the new engines (or drop the leaving ones) and take
   requests again. Leaving engines stop only after that, so no frontend sees one die.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from frontend.engine.client import AsyncEngineClient
from frontend.engine.process import EngineGroup
from protocol.errors import InvalidParameterError

logger = logging.getLogger("engine.launcher")
POLL_S = 0.1
MAX_ENGINES = 64


class ElasticScaler:
    def __init__(self, group: EngineGroup, register_timeout_s: float) -> None:
        self.group = group
        self.register_timeout_s = register_timeout_s
        self.scaling = False

    @property
    def size(self) -> int:
        return len(self.group.engines)

    def scale(self, new_size: int, drain_timeout_s: float) -> dict[str, Any]:
        """Blocking (the launcher's loop runs it); InvalidParameterError for a size it cannot take."""
        if not 1 <= new_size <= MAX_ENGINES:
            raise InvalidParameterError("new_data_parallel_size", f"takes 1..{MAX_ENGINES}, got {new_size}")
        if drain_timeout_s < 0:
            raise InvalidParameterError("drain_timeout", "must be 0 or more seconds")
        old_size = self.size
        if new_size == old_size:
            return {"data_parallel_size": old_size}
        self.scaling = True
        started = time.monotonic()
        try:
            asyncio.run(self._scale(old_size, new_size, drain_timeout_s))
        finally:
            self.scaling = False
        logger.info("scaled from %d to %d engines in %.1f s", old_size, new_size, time.monotonic() - started)
        return {"data_parallel_size": self.size}

    async def _scale(self, old_size: int, new_size: int, drain_timeout_s: float) -> None:
        group = self.group
        first = group.addresses(1)[0]
        head = AsyncEngineClient(first[0], first[1], f"launcher-elastic-{time.monotonic_ns()}")
        try:
            await head.register(self.register_timeout_s)
            current = group.addresses(old_size)
            await head.call_utility("set_engine_set", current, True)
            try:
                if new_size > old_size:
                    await self._grow(old_size, new_size)
                else:
                    await self._drain(range(new_size, old_size), drain_timeout_s)
            except BaseException:
                await head.call_utility("set_engine_set", current, False)
                raise
            await head.call_utility("set_engine_set", group.addresses(new_size), False)
            if new_size < old_size:
                group.stop(group.engines[new_size:])
        finally:
            head.close()

    async def _grow(self, old_size: int, new_size: int) -> None:
        engines = self.group.start_ranks(range(old_size, new_size))
        clients = [
            AsyncEngineClient(
                engine.config.input_address, engine.config.output_address, f"launcher-elastic-{i}"
            )
            for i, engine in enumerate(engines)
        ]
        try:
            await asyncio.gather(*(
                client.register(self.register_timeout_s, engine.is_alive)
                for client, engine in zip(clients, engines, strict=True)
            ))  # fmt: skip
        except BaseException as error:
            reason = next((why for engine in engines if (why := engine.refusal())), None)
            self.group.stop(engines)
            raise RuntimeError(f"a new engine did not start: {reason or error}") from None
        finally:
            for client in clients:
                client.close()
        self.group.adopt(engines)

    async def _drain(self, leaving: range, timeout_s: float) -> None:
        addresses = self.group.addresses(leaving.stop)
        clients = [
            AsyncEngineClient(addresses[r][0], addresses[r][1], f"launcher-drain-{r}") for r in leaving
        ]
        try:
            await asyncio.gather(*(client.register(self.register_timeout_s) for client in clients))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                states = await asyncio.gather(*(client.call_utility("get_stats") for client in clients))
                if all(state["num_running"] + state["num_waiting"] == 0 for state in states):
                    return
                await asyncio.sleep(POLL_S)
            for client in clients:  # past the drain timeout: the rest end now
                await client.call_utility("pause", "abort")
        finally:
            for client in clients:
                client.close()
