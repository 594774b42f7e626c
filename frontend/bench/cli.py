"""`engine bench serve | engine | throughput | latency | startup`: the benchmark harness's subcommands.

The harness is not part of the API server's import graph: only the `engine` CLI reaches it, and its
HTTP client libraries are imported when a benchmark runs.
"""

from __future__ import annotations

from typing import Any


def add_bench_parser(commands: Any) -> None:
    from frontend.bench.engine import add_engine_bench_parser
    from frontend.bench.offline import add_offline_bench_parsers
    from frontend.bench.serve import add_serve_bench_parser
    from frontend.bench.startup import add_startup_bench_parser

    bench = commands.add_parser("bench", help="benchmarks: serve, engine, throughput, latency, startup")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    add_serve_bench_parser(kinds)
    add_engine_bench_parser(kinds)
    add_offline_bench_parsers(kinds)
    add_startup_bench_parser(kinds)
