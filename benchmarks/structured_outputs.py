"""What structured outputs cost, in one invocation: grammar compile times over 50 varied JSON schemas
(llguidance, and xgrammar when it is installed), then c=16 streaming chat on a real server with a small
json_schema against the same load unconstrained, alternating, as a ratio.

    python -m benchmarks.structured_outputs [--rounds 2] [--num-prompts 64] [--output-len 128]

Writes benchmarks/results/structured-outputs-<date>.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}


def varied_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    leaves = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number", "minimum": -1, "maximum": 1},
        {"type": "boolean"},
        {"enum": ["a", "b", "c", 1, None]},
        {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        {"$ref": "#/$defs/point"},
    ]
    result = []
    for _ in range(count):
        properties: dict[str, Any] = {}
        for i in range(rng.randint(2, 8)):
            leaf = rng.choice(leaves)
            if rng.random() < 0.3:
                leaf = {
                    "type": "object",
                    "properties": {"inner": leaf, "flag": {"type": "boolean"}},
                    "required": ["inner"],
                }
            properties[f"field_{i}"] = leaf
        result.append(
            {
                "type": "object",
                "properties": properties,
                "required": sorted(properties),
                "$defs": {
                    "point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
                },
            }
        )
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def compile_times(model: str) -> dict[str, Any]:
    from protocol.structured_outputs import StructuredOutputsParams
    from structured_outputs import get_backend
    from structured_outputs.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    vocab = len(tokenizer)
    schemas = varied_schemas(50)
    report: dict[str, Any] = {}
    started = time.perf_counter()
    backend = get_backend("guidance", tokenizer, vocab, [tokenizer.eos_token_id])
    report["guidance_tokenizer_s"] = time.perf_counter() - started
    times = []
    for schema in schemas:
        started = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - started)
    report["guidance_compile_ms"] = {
        "p50": 1e3 * percentile(times, 0.5),
        "p99": 1e3 * percentile(times, 0.99),
    }
    try:
        import xgrammar
    except ImportError:
        return report
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    times = []
    for schema in schemas:
        started = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema))
        times.append(time.perf_counter() - started)
    report["xgrammar_compile_ms"] = {
        "p50": 1e3 * percentile(times, 0.5),
        "p99": 1e3 * percentile(times, 0.99),
    }
    return report


def serve_ratio(args: argparse.Namespace) -> dict[str, Any]:
    port = 8431
    server = subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "serve", "--port", str(port), "--max-model-len", "1024"],
        stdout=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError("the server exited")
            time.sleep(1)
        constrained = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL_SCHEMA}}
        }
        runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for round_index in range(args.rounds + 1):  # round 0 warms the server up and is not counted
            for name, extra in (("unconstrained", None), ("json_schema", constrained)):
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    command = [
                        sys.executable, "-m", "frontend.cli", "bench", "serve", "--base-url", base,
                        "--endpoint", "chat", "--max-concurrency", "16", "--num-prompts", str(args.num_prompts),
                        "--output-len", str(args.output_len), "--ignore-eos", "--quiet", "--output-json", out.name,
                    ]  # fmt: skip
                    if extra:
                        command += ["--extra-body", json.dumps(extra)]
                    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                    result = json.load(open(out.name))["summary"]
                    assert result["failed"] == 0, result["errors"]
                    if round_index:
                        runs[name].append(result["output_throughput"])
        base_tps, json_tps = statistics.median(runs["unconstrained"]), statistics.median(runs["json_schema"])
        return {"output_tok_s": runs, "ratio": json_tps / base_tps}
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    from frontend.model_files import default_model

    cpu = platform.processor() or "unknown"
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    report: dict[str, Any] = {"cpu": cpu, "date": datetime.date.today().isoformat()}
    report.update(compile_times(default_model()))
    report.update(serve_ratio(args))
    path = os.path.join(os.path.dirname(__file__), "results", f"structured-outputs-{report['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    compile_ms = report["guidance_compile_ms"]
    print(
        f"structured outputs ({cpu}): json_schema/unconstrained c=16 output tok/s = {report['ratio']:.3f}; "
        f"compile p50 {compile_ms['p50']:.2f} ms p99 {compile_ms['p99']:.2f} ms (llguidance, 50 schemas) -> {path}"
    )


if __name__ == "__main__":
    main()
