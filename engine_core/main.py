"""`python -m engine_core.main [PARENT_PID]`: the EngineCore process. Reads its EngineConfig as JSON on stdin."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

import msgspec

from engine_core.engine_core import EngineCore
from engine_core.executor import MultiprocExecutor, StartupRefusedError, WorkerDiedError
from engine_core.process import EngineCoreProc, bind_frontend_sockets, install_signal_handlers
from protocol.config import EngineConfig
from protocol.log_format import configure_logging
from protocol.startup import StartupPhases, exit_with_parent

logger = logging.getLogger("engine.core")


def main() -> None:
    phases = StartupPhases("engine")
    if len(sys.argv) > 1:  # started by a launcher or the offline API: SIGTERM (a drain) when it dies
        exit_with_parent(int(sys.argv[1]), signal.SIGTERM)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    configure_logging(config.log_level, config.log_format)
    if config.executor != "mp":
        raise SystemExit(f"the engine process runs the 'mp' executor only, not {config.executor!r}")
    phases.mark("imports")
    sockets = bind_frontend_sockets(config)  # before the worker: see there
    try:
        if config.worker.parallel.executor_backend == "ray":
            from engine_core.ray_executor import RayExecutor

            executor: MultiprocExecutor = RayExecutor(config.worker)
        else:
            executor = MultiprocExecutor(config.worker)
    except WorkerDiedError as error:  # the worker has logged why; the engine cannot start without it
        logger.error("the engine cannot start: %s", error)
        raise SystemExit(1) from None
    except StartupRefusedError as error:  # the user's model or settings: the launcher says why, in one line
        if config.refusal_path:
            with open(config.refusal_path, "w") as f:
                f.write(str(error))
        raise SystemExit(2) from None
    phases.mark("worker")
    proc = EngineCoreProc(config, EngineCore(config, executor), sockets)
    install_signal_handlers(proc)
    gc.collect()
    gc.freeze()  # startup's objects are never garbage: full collections need not walk them
    phases.mark("sockets")
    phases.log(logger)
    proc.run()
    # Stopped cleanly: sockets closed, workers gone. Skip the interpreter's teardown of the scheduler's
    # objects (every KV block is one) that a stop would otherwise wait on.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
