"""Where a CUDA engine step's time goes: the engine core and a worker in one process (no HTTP, no ZMQ), the
random workload of `make gpu-check` (PROMPTS prompts of INPUT_LEN random tokens, OUTPUT_LEN tokens each, all
at once), run three times: plain (each step's schedule, model and update times, by kind: decode only or with
prefill), under cProfile (the host's hot functions), and a window of steps under torch.profiler (the kernels'
GPU time against the window's wall time). Needs a GPU; prints everything, and writes the summary as JSON.

    python -m benchmarks.gpu_step_profile MODEL_FOLDER [--prompts 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from typing import Any

import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from worker.executor import InprocExecutor


def make_core(args: argparse.Namespace) -> EngineCore:
    worker = WorkerConfig(model=args.model, device=args.device, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    config = EngineConfig(worker=worker, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    return EngineCore(config, InprocExecutor(worker))


def add_workload(core: EngineCore, args: argparse.Namespace, seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.prompts):
        prompt = [rng.randrange(100, 30000) for _ in range(args.input_len)]
        core.add_request(AddRequest(request_id=f"{seed}-{i}", prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=time.time()))  # fmt: skip


def timed_run(core: EngineCore, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Each phase of each step timed: schedule() and update_from_output() on the scheduler, execute_model()
    on the runner (it returns host lists of tokens, so the GPU's work is in it)."""
    scheduler, runner = core.scheduler, core.executor.runner  # type: ignore[attr-defined]
    steps: list[dict[str, Any]] = []
    schedule, update, execute = scheduler.schedule, scheduler.update_from_output, runner.execute_model

    def timed_schedule():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = schedule()
        if out is not None:
            prefill = sum(1 for r in out.new_requests) + sum(
                1 for n in out.num_scheduled_tokens.values() if n > 1
            )
            steps.append({"tokens": out.total_num_scheduled_tokens, "rows": len(out.num_scheduled_tokens),
                          "prefill": prefill > 0, "schedule": time.perf_counter() - start})  # fmt: skip
        return out

    def timed_execute(out):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = execute(out)
        next(s for s in steps if "execute" not in s)["execute"] = time.perf_counter() - start
        return result

    def timed_update(out):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = update(out)
        next(s for s in steps if "update" not in s)["update"] = time.perf_counter() - start
        return result

    scheduler.schedule, scheduler.update_from_output, runner.execute_model = (
        timed_schedule, timed_update, timed_execute,
    )  # fmt: skip
    add_workload(core, args, seed)
    start = time.perf_counter()
    generated = 0
    while core.has_unfinished_requests():
        generated += sum(len(output.new_token_ids) for _, output in core.step())
    wall = time.perf_counter() - start
    scheduler.schedule, scheduler.update_from_output, runner.execute_model = schedule, update, execute
    summary: dict[str, Any] = {"wall_s": wall, "output_tokens": generated, "output_tok_per_s": generated / wall,
                               "steps": len(steps)}  # fmt: skip
    for kind, chosen in (("decode", [s for s in steps if not s["prefill"]]),
                         ("with_prefill", [s for s in steps if s["prefill"]])):  # fmt: skip
        if chosen:
            summary[kind] = {
                "steps": len(chosen),
                "mean_rows": statistics.mean(s["rows"] for s in chosen),
                "mean_tokens": statistics.mean(s["tokens"] for s in chosen),
                **{
                    f"{phase}_ms": 1000 * statistics.mean(s.get(phase, 0.0) for s in chosen)
                    for phase in ("schedule", "execute", "update")
                },  # fmt: skip
            }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    args = parser.parse_args()
    core = make_core(args)
    timed_run(core, argparse.Namespace(**{**vars(args), "prompts": 16, "output_len": 8}), seed=0)  # warm-up
    cuda = args.device == "cuda"
    report: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    report["plain"] = timed_run(core, args, seed=1)
    print("plain:", json.dumps(report["plain"], indent=1))

    profile = cProfile.Profile()
    profile.enable()
    report["under_cprofile"] = timed_run(core, args, seed=2)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print("cProfile, by own time:\n" + "\n".join(text.getvalue().splitlines()[:50]))

    add_workload(core, args, seed=3)
    for _ in range(40):  # into the steady state: prefills mixed with decodes
        core.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(20):
            core.step()
        if cuda:
            torch.cuda.synchronize()
        window = time.perf_counter() - start
    while core.has_unfinished_requests():
        core.step()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    report["torch_profiler"] = {
        "window_s": window,
        "gpu_busy_s": gpu_us / 1e6,
        "gpu_busy_share": gpu_us / 1e6 / window,
    }
    print("torch.profiler over 20 steps:", json.dumps(report["torch_profiler"]))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=15))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    core.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
