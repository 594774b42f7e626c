"""Disaggregated prefill and decode on one machine (docs/scale-out.md): TTFT and ITL through `engine proxy`
(a prefill and a decode `engine serve`, the shared-storage connector on /dev/shm) against one `engine serve`
of the same model and flags, at c=1 and c=16, in one invocation; then the connector's own rate: a step's
entry written and read back through the worker's SharedStorageKV, in bytes per second.

Both engines of the disaggregated pair share this machine's cores, so expect no gain here: the point is
what the hand-over costs (one more HTTP hop and a prefill answer, the entry's write and read).

    python -m benchmarks.disaggregated [--model MODEL] [--input-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.serve_helpers import free_port, stop, wait_healthy


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


def serve_pass(args: argparse.Namespace, flags: list[str], storage: Path | None) -> dict[int, dict[str, Any]]:
    processes = []
    try:
        if storage is None:
            process, base = start(["serve", *args.model, *flags])
            processes.append(process)
            wait_healthy(process, base)
        else:
            bases = []
            for role in ("kv_producer", "kv_consumer"):
                config = {"kv_connector": "SharedStorageConnector", "kv_role": role,
                          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
                process, base = start(
                    ["serve", *args.model, *flags, "--kv-transfer-config", json.dumps(config)]
                )
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


def connector_rate(args: argparse.Namespace) -> tuple[int, float, float]:
    """Bytes of one entry of input-len tokens in SmolLM2-135M's float32 pool shape, and its write and read
    rates (bytes/s), through worker/kv_transfer.py on /dev/shm (median of five)."""
    import statistics

    import torch

    from protocol.kv_transfer import KVLoad, KVSave, KVTransferConfig
    from worker.kv_transfer import SharedStorageKV

    blocks = args.input_len // 64
    pool = [torch.randn(blocks * 2, 2, 64, 3, 64) for _ in range(30)]  # 30 layers, 3 KV heads of 64
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        config = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                                  kv_connector_extra_config={"shared_storage_path": folder})  # fmt: skip
        kv = SharedStorageKV(config)
        for i in range(5):
            key = f"{i:064x}"
            started = time.perf_counter()
            kv.save([KVSave("r", key, list(range(blocks)))], pool)
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert not kv.load([KVLoad("r", key, 0, list(range(blocks, 2 * blocks)))], pool)
            reads.append(time.perf_counter() - started)
        assert all(torch.equal(layer[:blocks], layer[blocks:]) for layer in pool)
    size = kv.num_bytes_saved // 5
    return size, size / statistics.median(writes), size / statistics.median(reads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="*", default=[], help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrent client")
    args = parser.parse_args(argv)
    flags = ["--max-model-len", "2048"]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        results = {
            "one engine": serve_pass(args, flags, None),
            "proxy (P+D)": serve_pass(args, flags, Path(folder)),
        }
    print(f"{'':12} {'c':>3} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'out tok/s':>10}")
    for name, by_c in results.items():
        for c, summary in by_c.items():
            print(f"{name:12} {c:>3} {summary['ttft_s']['p50'] * 1e3:>12.1f} {summary['itl_s']['p50'] * 1e3:>11.1f} "
                  f"{summary['output_throughput']:>10.1f}")  # fmt: skip
    for c in (1, 16):
        one, pd = results["one engine"][c], results["proxy (P+D)"][c]
        print(f"c={c}: proxy/one TTFT x{pd['ttft_s']['p50'] / one['ttft_s']['p50']:.2f}, "
              f"ITL x{pd['itl_s']['p50'] / one['itl_s']['p50']:.2f}, "
              f"throughput x{pd['output_throughput'] / one['output_throughput']:.2f}")  # fmt: skip
    size, write, read = connector_rate(args)
    print(f"shared-storage entry of {args.input_len} tokens ({size / 1e6:.1f} MB): write {write / 1e9:.2f} GB/s, "
          f"read {read / 1e9:.2f} GB/s (/dev/shm)")  # fmt: skip


if __name__ == "__main__":
    main()
