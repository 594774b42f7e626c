"""Starting and stopping EngineCore processes (`python -m engine_core.main`) from a frontend: one, or the
data-parallel engines this machine hosts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys

import msgspec

from protocol import temp_folders
from protocol.config import EngineConfig
from protocol.startup import RUN_DIR_ENV, parent_pid_arg


class EngineRefusedError(ValueError):
    """The engine refused to start: the model's architecture, or a setting it does not take (one line)."""


class EngineProcess:
    """Owns the engine process; the engine in turn owns its workers."""

    def __init__(self, config: EngineConfig) -> None:
        # the engine's own folder: its default sockets and its workers' (RUN_DIR_ENV), removed at shutdown
        # even when the engine was killed
        temp_folders.sweep()  # what a launcher or engine killed with SIGKILL left behind
        self._ipc_dir: str | None = temp_folders.folder("run")
        if not config.input_address or not config.output_address:
            config.input_address = config.input_address or f"ipc://{self._ipc_dir}/input"
            config.output_address = config.output_address or f"ipc://{self._ipc_dir}/output"
        # where the engine writes why it refused to start (the model or settings: exit code 2)
        config.refusal_path = temp_folders.file("refusal")
        self.config = config
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine_core.main", parent_pid_arg()],
            stdin=subprocess.PIPE,
            env={**os.environ, RUN_DIR_ENV: self._ipc_dir},
        )
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(config))
        self.process.stdin.close()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def refusal(self) -> str | None:
        """Why the engine refused to start (exit code 2: an architecture or setting we do not serve)."""
        if self.process.poll() != 2:
            return None
        try:
            with open(self.config.refusal_path) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def terminate(self) -> None:
        """Ask the engine to drain and exit (SIGTERM); `shutdown` waits for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        with contextlib.suppress(OSError):
            os.unlink(self.config.refusal_path)

    @property
    def pid(self) -> int:
        return self.process.pid


def rank_addresses(input_address: str, output_address: str, rank: int) -> tuple[str, str]:
    """Data-parallel engine `rank`'s addresses, from engine 0's: tcp ports 2 x rank above, ipc paths with
    a -dpRANK suffix."""
    if rank == 0:
        return input_address, output_address

    def shifted(address: str) -> str:
        if address.startswith("tcp://"):
            host, _, port = address.rpartition(":")
            return f"{host}:{int(port) + 2 * rank}"
        return f"{address}-dp{rank}"

    return shifted(input_address), shifted(output_address)


class EngineGroup:
    """The engines this machine runs: one, or data-parallel ranks `local_ranks` of `size`, each with its own
    workers and KV cache. Every engine's config lists every engine's addresses, so that a frontend that
    registers with any of them finds the rest."""

    def __init__(
        self,
        config: EngineConfig,
        size: int = 1,
        local_ranks: range | None = None,
        head: str = "",
        elastic: bool = False,
    ) -> None:
        """head: engine 0's input address, when it runs on another machine (ours announce themselves to it);
        without one, engines of `size` this machine does not run are on other machines, to be announced.
        elastic: the set may grow and shrink at run time (`start_ranks`, `stop_ranks`), so even one engine
        lists itself (its frontends then speak to it as to several)."""
        self._ipc_dir: str | None = None
        listed = size > 1 or elastic
        if listed and (not config.input_address or not config.output_address):
            self._ipc_dir = temp_folders.folder("dp")
            config.input_address = f"ipc://{self._ipc_dir}/input"
            config.output_address = f"ipc://{self._ipc_dir}/output"
        local = local_ranks if local_ranks is not None else range(size)
        addresses = [
            list(rank_addresses(config.input_address, config.output_address, r))
            if r in local or head
            else ["", ""]
            for r in range(size)
        ]
        config.data_parallel_head = head
        if len(local) > 1:  # their workers share this machine's cores
            parallel = msgspec.structs.replace(config.worker.parallel, engines_per_node=len(local))
            config.worker = msgspec.structs.replace(config.worker, parallel=parallel)
        self.engines = []
        try:
            for index, rank in enumerate(local):
                rank_config = _rank_config(config, rank, addresses if listed else [], index)
                self.engines.append(EngineProcess(rank_config))
        except BaseException:
            self.shutdown()
            raise
        self.config = self.engines[0].config  # the first local engine's, its addresses filled in
        self.base_config = config  # what a rank added later is made from (elastic)
        self.elastic = elastic

    def addresses(self, size: int) -> list[list[str]]:
        """Every engine's [input, output] in a set of `size` on this machine."""
        base = self.base_config
        return [list(rank_addresses(base.input_address, base.output_address, r)) for r in range(size)]

    def start_ranks(self, ranks: range) -> list[EngineProcess]:
        """Engines for these ranks (elastic: the set grows), not yet counted as members: `adopt` them once
        they answer, or `stop` them."""
        addresses = self.addresses(ranks.stop)
        started: list[EngineProcess] = []
        try:
            for rank in ranks:
                started.append(EngineProcess(_rank_config(self.base_config, rank, addresses, rank)))
        except BaseException:
            self.stop(started)
            raise
        return started

    def adopt(self, engines: list[EngineProcess]) -> None:
        self.engines += engines

    def stop(self, engines: list[EngineProcess], timeout_s: float = 30.0) -> None:
        """Stop these engines (members leave the set first: their exit is not a death)."""
        self.engines = [engine for engine in self.engines if engine not in engines]
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.shutdown(timeout_s)

    def is_alive(self) -> bool:
        """Every engine: one that died makes the deployment unhealthy, as a lone engine's death does."""
        return all(engine.is_alive() for engine in self.engines)

    def refusal(self) -> str | None:
        """Why an engine refused to start, if one did (EngineProcess.refusal)."""
        return next((reason for engine in self.engines if (reason := engine.refusal())), None)

    @property
    def returncode(self) -> int | None:
        """The exit code of the first engine that exited (None while all run)."""
        return next((e.process.returncode for e in self.engines if e.process.poll() is not None), None)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        for engine in self.engines:
            engine.terminate()  # all drain at once
        for engine in self.engines:
            engine.shutdown(timeout_s)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @property
    def pid(self) -> int:
        return self.engines[0].pid


def _rank_config(config: EngineConfig, rank: int, addresses: list[list[str]], index: int = 0) -> EngineConfig:
    """Engine `rank`'s config; index: its place among this machine's engines."""
    if not addresses:
        return msgspec.structs.replace(config)
    parallel = msgspec.structs.replace(config.worker.parallel, engine_index=index)
    if parallel.master_port:  # each engine's ranks meet on a port of their own
        parallel = msgspec.structs.replace(parallel, master_port=parallel.master_port + rank)
    input_address, output_address = addresses[rank]
    return msgspec.structs.replace(
        config,
        input_address=input_address,
        output_address=output_address,
        data_parallel_rank=rank,
        data_parallel_addresses=addresses,
        worker=msgspec.structs.replace(config.worker, parallel=parallel),
    )


class WorkerNode:
    """A machine past the first of an engine's tensor-parallel ranks (--nnodes, --node-rank above 0): it runs
    its share of the ranks (`python -m worker.main -`), which join rank 0's store at --master-addr and hear
    the engine through rank 0. No engine and no HTTP here."""

    def __init__(self, config: EngineConfig) -> None:
        worker = config.worker
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in worker.parallel.local_ranks:
            process = subprocess.Popen(
                [sys.executable, "-m", "worker.main", "-", parent_pid_arg()], stdin=subprocess.PIPE
            )
            assert process.stdin is not None
            process.stdin.write(msgspec.json.encode(msgspec.structs.replace(worker, rank=rank)))
            process.stdin.close()
            self.processes.append(process)
        self.config = config

    def is_alive(self) -> bool:
        """Every rank: one that exits (its engine gone, or its own fault) ends the node."""
        return all(process.poll() is None for process in self.processes)

    @property
    def returncode(self) -> int | None:
        return next((p.returncode for p in self.processes if p.poll() is not None), None)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """The ranks have nothing to drain (the engine owns the requests): SIGTERM, then SIGKILL."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    @property
    def pid(self) -> int:
        return self.processes[0].pid
