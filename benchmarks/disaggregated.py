"""Disaggregated prefill and decode on one machine (docs/scale-out.md): TTFT and ITL through `engine proxy`
(a prefill and a decode `engine serve`, over the shared-storage connector on /dev/shm and over NIXL) against
one `engine serve` of the same model and flags, at c=1 and c=16, in one invocation; then each connector's
own rate: one prompt's entry written and read back through the worker's connector, in bytes per second
(NIXL: UCX's own choice of transport, and UCX_TLS=tcp).

Both engines of a disaggregated pair share this machine's cores (each worker takes half of them, the one
engine all), so expect no gain here: the point is what the hand-over costs (one more HTTP hop and a prefill
answer, the entry's write and read) and how the split of prefill and decode shows in TTFT and ITL.

    python -m benchmarks.disaggregated [--model MODEL] [--input-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.serve_helpers import free_port, stop, wait_healthy

PAIRS = {"P+D storage": "SharedStorageConnector", "P+D NIXL": "NixlConnector"}


def start(command: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "frontend.cli", *command, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return process, f"http://127.0.0.1:{port}"


def bench(base: str, args: argparse.Namespace, concurrency: int, seed: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "frontend.cli", "bench", "serve", "--base-url", base, "--endpoint",
                        "completions", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--ignore-eos", "--num-prompts", str(concurrency * args.rounds), "--max-concurrency",
                        str(concurrency), "--seed", str(seed), "--quiet", "--output-json", out.name],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        return json.loads(Path(out.name).read_text())["summary"]  # type: ignore[no-any-return]


def serve_pass(
    args: argparse.Namespace, flags: list[str], connector: str | None
) -> dict[int, dict[str, Any]]:
    """One engine (connector None), or a prefill and a decode engine behind `engine proxy`: c=1 and c=16."""
    processes = []
    try:
        if connector is None:
            process, base = start(["serve", *args.model, *flags])
            processes.append(process)
            wait_healthy(process, base)
        else:
            bases = []
            extra = {"side_channel_port": free_port()} if connector == "NixlConnector" else {
                "shared_storage_path": args.storage}  # fmt: skip
            for role in ("kv_producer", "kv_consumer"):
                config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
                # NOTE: the pair splits the cores (one engine has them all): two workers each spinning
                # OpenMP threads over every core would measure the oversubscription, not the hand-over
                half = ["--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]
                command = ["serve", *args.model, *flags, *half, "--kv-transfer-config", json.dumps(config)]
                process, base = start(command)
                processes.append(process)
                bases.append(base)
            for process, base in zip(processes, bases, strict=True):
                wait_healthy(process, base)
            process, base = start(["proxy", "--prefill", bases[0], "--decode", bases[1]])
            processes.append(process)
            wait_healthy(process, base, 60)
        httpx.post(base + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=120)
        return {c: bench(base, args, c, seed=c) for c in (1, 16)}
    finally:
        for process in reversed(processes):
            stop(process)


def connector_rate(connector: str, input_len: int) -> tuple[int, float, float]:
    """Bytes of one entry of input_len tokens in SmolLM2-135M's float32 pool shape (30 layers, 3 KV heads of
    64), and its write and read rates (bytes/s) through the worker's connector (median of five)."""
    import statistics

    import torch

    from protocol.kv_transfer import KVLoad, KVSave, KVTransferConfig
    from worker.kv_transfer import kv_connector_for

    blocks = input_len // 64
    pool = [torch.randn(blocks * 2, 2, 64, 3, 64) for _ in range(30)]
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        port = free_port()
        extra = (
            {"side_channel_port": port} if connector == "NixlConnector" else {"shared_storage_path": folder}
        )
        sides = [kv_connector_for(KVTransferConfig(kv_connector=connector, kv_role=role,
                                                   kv_connector_extra_config=extra))
                 for role in ("kv_producer", "kv_consumer")]  # fmt: skip
        producer, consumer = sides
        assert producer is not None and consumer is not None
        for i in range(5):
            key = f"{i:064x}"
            started = time.perf_counter()
            producer.save([KVSave("r", key, list(range(blocks)))], pool)
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            load = KVLoad("r", key, 0, list(range(blocks, 2 * blocks)), f"127.0.0.1:{port}")
            assert not consumer.load([load], pool)
            reads.append(time.perf_counter() - started)
        assert all(torch.equal(layer[:blocks], layer[blocks:]) for layer in pool)
        for side in sides:
            if hasattr(side, "close"):
                side.close()
    size = producer.num_bytes_saved // 5
    return size, size / statistics.median(writes), size / statistics.median(reads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="*", default=[], help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrent client")
    parser.add_argument("--rate-only", default=None, help=argparse.SUPPRESS)  # one connector's rate, as JSON
    args = parser.parse_args(argv)
    if args.rate_only:
        print(json.dumps(connector_rate(args.rate_only, args.input_len)))
        return
    flags = ["--max-model-len", "2048"]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        args.storage = folder
        results = {"one engine": serve_pass(args, flags, None)}
        results.update({name: serve_pass(args, flags, connector) for name, connector in PAIRS.items()})
    print(f"{'':12} {'c':>3} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'out tok/s':>10}")
    for name, by_c in results.items():
        for c, summary in by_c.items():
            print(f"{name:12} {c:>3} {summary['ttft_s']['p50'] * 1e3:>12.1f} {summary['itl_s']['p50'] * 1e3:>11.1f} "
                  f"{summary['output_throughput']:>10.1f}")  # fmt: skip
    for name in PAIRS:
        for c in (1, 16):
            one, pair = results["one engine"][c], results[name][c]
            print(f"{name} c={c}, over one engine: TTFT x{pair['ttft_s']['p50'] / one['ttft_s']['p50']:.2f}, "
                  f"ITL x{pair['itl_s']['p50'] / one['itl_s']['p50']:.2f}, "
                  f"throughput x{pair['output_throughput'] / one['output_throughput']:.2f}")  # fmt: skip
    for connector, env in (
        ("SharedStorageConnector", {}),
        ("NixlConnector", {}),
        ("NixlConnector", {"UCX_TLS": "tcp"}),
    ):
        answer = subprocess.run([sys.executable, "-m", "benchmarks.disaggregated", "--rate-only", connector,
                                 "--input-len", str(args.input_len)], env={**os.environ, **env}, check=True,
                                capture_output=True, text=True)  # fmt: skip
        size, write, read = json.loads(answer.stdout.strip().splitlines()[-1])
        print(f"{connector}{' UCX_TLS=tcp' if env else ''}: an entry of {args.input_len} tokens ({size / 1e6:.1f} "
              f"MB) written at {write / 1e9:.2f} GB/s, read at {read / 1e9:.2f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
