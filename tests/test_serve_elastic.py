"""End to end: elastic data parallel (`engine serve --enable-elastic-ep`): 1 -> 2 -> 1 engines while a
steady load runs through the launching server's API server and a frontend attached from elsewhere. Every
answer is 200 with the greedy text of the unscaled server, or 503 with Retry-After while the set changes;
both frontends route to the new engine once it joins; a scale whose new engine cannot start (its model
file is gone) fails and leaves the old set serving."""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve_helpers import Served, attached_frontend, serving, wait_until

pytestmark = pytest.mark.slow

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def model(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("elastic")
    copy = folder / "smollm2.gguf"
    shutil.copyfile(smollm2_gguf, copy)
    return str(copy)


@pytest.fixture(scope="module")
def served(model: str) -> Iterator[Served]:
    with serving(model, "--max-model-len", "512", "--enable-elastic-ep", engine_address=True) as served:
        yield served


def completion(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=BODY, timeout=120)


def scale(served: Served, size: int, **extra: Any) -> httpx.Response:
    body = {"new_data_parallel_size": size, **extra}
    return httpx.post(f"{served.base}/scale_elastic_ep", json=body, timeout=600)


def served_by(base: str, rank: int) -> float:
    """Requests engine `rank` finished for this frontend (its /metrics)."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("engine:request_success_total{") and f'engine="{rank}"' in line:
            total += float(line.split()[-1])
    return total


@pytest.mark.long  # a drill under load across processes: engines start and stop while it runs
def test_one_to_two_to_one_under_load(served: Served) -> None:
    reference = completion(served.base).json()["choices"][0]["text"]
    with attached_frontend(served) as attached:
        bases = [served.base, attached.base]
        answers: list[tuple[int, str | None, str | None]] = []
        stop = threading.Event()

        def load(base: str) -> None:
            while not stop.is_set():
                answer = completion(base)
                text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else None
                answers.append((answer.status_code, text, answer.headers.get("retry-after")))

        threads = [threading.Thread(target=load, args=(bases[i % 2],)) for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(answers) >= 4, 60, "the load to run")
            grown = scale(served, 2)
            assert grown.status_code == 200, grown.text
            assert grown.json() == {"message": "Scaled to 2 data parallel engines", "data_parallel_size": 2}
            assert httpx.post(f"{attached.base}/is_scaling_elastic_ep").json() == {
                "is_scaling_elastic_ep": False
            }
            for base in bases:  # both frontends joined the new engine
                wait_until(lambda base=base: served_by(base, 1) > 0, 60, f"{base} to use engine 1")
            shrunk = scale(served, 1, drain_timeout=60)
            assert shrunk.status_code == 200, shrunk.text
            after = len(answers)
            wait_until(lambda: len(answers) >= after + 4, 60, "the load to go on with one engine")
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
    statuses = {status for status, _, _ in answers}
    assert statuses <= {200, 503}, statuses
    assert sum(status == 200 for status, _, _ in answers) >= 8
    assert all(text == reference for status, text, _ in answers if status == 200)
    assert all(retry for status, _, retry in answers if status == 503)
    assert completion(served.base).json()["choices"][0]["text"] == reference


@pytest.mark.long  # a failure drill
def test_a_scale_that_cannot_start_an_engine_leaves_the_old_set(served: Served, model: str) -> None:
    moved = pathlib.Path(model + ".away")
    os.rename(model, moved)
    try:
        failed = scale(served, 2)
    finally:
        os.rename(moved, model)
    assert failed.status_code == 500 and "did not start" in failed.json()["error"]["message"]
    assert httpx.post(f"{served.base}/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
    assert completion(served.base).status_code == 200
    assert httpx.get(f"{served.base}/health").status_code == 200
    refused = scale(served, 0)
    assert refused.status_code == 400  # (pydantic: at least 1)
