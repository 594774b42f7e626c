"""`python -m engine_core.main`: the EngineCore process. Reads its EngineConfig as JSON on stdin."""

from __future__ import annotations

import gc
import sys

import msgspec

from engine_core.engine_core import EngineCore
from engine_core.executor import MultiprocExecutor
from engine_core.process import EngineCoreProc, install_signal_handlers
from protocol.config import EngineConfig
from protocol.log_format import configure_logging


def main() -> None:
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    configure_logging(config.log_level, config.log_format)
    if config.executor != "mp":
        raise SystemExit(f"the engine process runs the 'mp' executor only, not {config.executor!r}")
    executor = MultiprocExecutor(config.worker)
    proc = EngineCoreProc(config, EngineCore(config, executor))
    install_signal_handlers(proc)
    gc.collect()
    gc.freeze()  # startup's objects are never garbage: full collections need not walk them
    proc.run()


if __name__ == "__main__":
    main()
