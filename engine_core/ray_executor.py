"""The Ray executor (--distributed-executor-backend ray): the tensor-parallel ranks are placed by Ray, one
actor per rank in a placement group of tensor_parallel_size bundles, on whichever nodes of the cluster
have the resources; the engine speaks to rank 0 over ZMQ (tcp) exactly as the mp executor does.

NOTE: each actor hosts its rank's worker as a child process (`python -m worker.main`), the same program
the mp executor starts, so the worker's code, its msgspec messages and its fault handling are one path for
both; Ray carries only the start (an address and the config's JSON). The engine process never imports
torch either way. Ray is an optional extra: `pip install '.[ray]'`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import msgspec

from engine_core.executor import MultiprocExecutor, WorkerDiedError, free_port
from protocol.config import WorkerConfig

logger = logging.getLogger("engine.core")
PLACEMENT_TIMEOUT_S = 60.0  # a cluster without the resources for every rank fails the start after this


class RankHost:
    """A Ray actor holding one rank's place (its bundle's CPUs or GPU) and running its worker process."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def node(self) -> tuple[str, int]:
        """(this node's address, its CPU count): where rank 0's store listens, and the ranks' threads."""
        import ray

        return ray.util.get_node_ip_address(), os.cpu_count() or 1  # type: ignore[no-untyped-call]

    def free_port(self) -> int:
        """A port free on this node: rank 0's store listens on it."""
        return free_port("0.0.0.0")

    def start(self, address: str, config_json: bytes) -> int:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "worker.main", address, str(os.getpid())], stdin=subprocess.PIPE
        )  # it exits with this actor (the worker's parent check)
        assert self.process.stdin is not None
        self.process.stdin.write(config_json)
        self.process.stdin.close()
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float) -> int | None:
        """Wait for the worker to leave (it was told to), then kill it."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class RayRank:
    """An actor's rank as the executor sees a process: poll(), wait(timeout), kill(). poll() is the answer
    of the executor's last health check (RayExecutor.check_health asks every actor at once)."""

    def __init__(self, actor: Any, rank: int) -> None:
        self.actor, self.rank = actor, rank
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float) -> int | None:
        import ray

        try:
            code: int | None = ray.get(self.actor.stop.remote(timeout), timeout=timeout + 30)
            return code
        except ray.exceptions.RayError:
            return -1

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


class RayExecutor(MultiprocExecutor):
    HEALTH_INTERVAL_S = 1.0  # the busy loop checks health often when idle; the actors are asked this often
    HEALTH_TIMEOUT_S = 10.0  # actors that do not answer a health check for this long count as gone

    def __init__(self, config: WorkerConfig, load_timeout_s: float = 600.0) -> None:
        try:
            import ray
        except ImportError:
            raise WorkerDiedError(
                "--distributed-executor-backend ray needs Ray: pip install '.[ray]' (or pip install ray)"
            ) from None
        # RAY_ADDRESS (or a cluster `ray start` made on this machine) is joined; else Ray starts one here
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING, log_to_driver=False)
        self._ray = ray
        self._placement: Any = None
        self._checked_at = 0.0
        self._unanswered_since: float | None = None
        super().__init__(config, load_timeout_s)

    def check_health(self) -> None:
        """Every actor's worker at once, at most once a second; an actor that is gone (its node lost) or
        that has not answered for HEALTH_TIMEOUT_S is a dead rank."""
        now = time.monotonic()
        if now - self._checked_at >= self.HEALTH_INTERVAL_S:
            self._checked_at = now
            ray = self._ray
            ranks: list[RayRank] = self._processes
            try:
                codes = ray.get(
                    [rank.actor.poll.remote() for rank in ranks], timeout=self.HEALTH_TIMEOUT_S / 4
                )
                self._unanswered_since = None
                for rank, code in zip(ranks, codes, strict=True):
                    rank.code = code
            except ray.exceptions.RayActorError:
                for rank in ranks:  # which one does not matter: the engine fails either way
                    rank.code = -1
            except ray.exceptions.GetTimeoutError:
                self._unanswered_since = self._unanswered_since or now
                if now - self._unanswered_since > self.HEALTH_TIMEOUT_S:
                    raise WorkerDiedError(
                        f"the Ray actors have not answered for {self.HEALTH_TIMEOUT_S:.0f} s"
                    ) from None
        super().check_health()

    def _bind(self) -> str:
        """tcp on this node's address: rank 0 may run on another node of the cluster."""
        host = self._ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    def _start_ranks(self, config: WorkerConfig, address: str) -> list[Any]:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = config.parallel.tensor_parallel_size
        self._placement = ray.util.placement_group([{"CPU": 1}] * size, strategy="PACK")
        try:
            ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerDiedError(
                f"the Ray cluster did not find {size} CPUs for the ranks within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(it has {ray.cluster_resources().get('CPU', 0):.0f})"
            ) from None
        actor_class = ray.remote(num_cpus=1)(RankHost)
        actors = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=r
                )
            ).remote()
            for r in range(size)
        ]
        nodes = ray.get([actor.node.remote() for actor in actors])
        master, port = nodes[0][0], ray.get(actors[0].free_port.remote())  # rank 0's node may be another
        parallel = msgspec.structs.replace(
            config.parallel, nnodes=1, node_rank=0, master_addr=master, master_port=port
        )
        ranks_here = {host: sum(1 for h, _ in nodes if h == host) for host, _ in nodes}
        logger.info("Ray placed the %d ranks on %s", size, ", ".join(host for host, _ in nodes))
        for rank, (actor, (host, cpus)) in enumerate(zip(actors, nodes, strict=True)):
            threads = config.num_threads or max(1, cpus // ranks_here[host])  # a node's cores, shared
            rank_config = msgspec.structs.replace(config, parallel=parallel, rank=rank, num_threads=threads)
            ray.get(actor.start.remote(address if rank == 0 else "-", msgspec.json.encode(rank_config)))
        return [RayRank(actor, rank) for rank, actor in enumerate(actors)]

    def shutdown(self) -> None:
        super().shutdown()
        ray = self._ray
        for rank in self._processes:
            ray.kill(rank.actor)
        if self._placement is not None:
            ray.util.remove_placement_group(self._placement)
        ray.shutdown()
