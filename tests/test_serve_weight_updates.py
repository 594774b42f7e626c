"""End to end: weight updates for RL loops over vLLM's dev-mode routes (docs/rl-weight-updates.md). A tiny
random Llama checkpoint A is served (`--weight-transfer-config '{"backend": "gloo"}'`); a trainer
(this test process through worker/weight_transfer_client.py, or a process of its own) sends checkpoint
B's weights over a gloo group; after finish, greedy tokens equal HF transformers' on B, on one rank and
with -tp 2 (each rank cuts its shard). A start in mode abort ends open requests and refuses new ones
until finish; a trainer that dies mid-update leaves the served weights and an error."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.hf_oracle import hf_greedy
from tests.quant_writers import tiny_llama
from tests.serve_helpers import Served, serving, wait_until
from worker.weight_transfer_client import WeightTransferClient, WeightTransferError

pytestmark = pytest.mark.slow

PROMPT = [5, 80, 33, 101, 7, 250, 9, 14]
NEW_TOKENS = 12
CONFIG = json.dumps({"backend": "gloo", "timeout_s": 30})
FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
    "--weight-transfer-config",
    CONFIG,
)
DEV = {"ENGINE_SERVER_DEV_MODE": "1"}
TRAINER = """
import os, sys
from transformers import AutoModelForCausalLM
from worker.weight_transfer_client import WeightTransferClient
base, folder, die = sys.argv[1], sys.argv[2], sys.argv[3] == "die"
model = AutoModelForCausalLM.from_pretrained(folder)
client = WeightTransferClient(base, timeout_s=30)
client.init()
if not die:
    client.send(model.named_parameters(), version="from-a-process")
    sys.exit(0)
from protocol.weight_transfer import UpdateInfo
from worker.weight_transfer import broadcast_all
from worker.weight_transfer_client import _in_background
named = list(model.named_parameters())
info = UpdateInfo(names=[n for n, _ in named], dtype_names=["float32"] * len(named),
                  shapes=[list(t.shape) for _, t in named])
client.request("POST", "/start_weight_update", {"mode": "keep"})
body = {"update_info": {f: getattr(info, f) for f in info.__struct_fields__}}
_in_background(lambda: client.request("POST", "/update_weights", body))
broadcast_all(client.group, [t.detach() for _, t in named[: len(named) // 2]], 1)
os._exit(3)  # mid-update
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folders: dict[str, Any] = {}
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        model = tiny_llama(seed=seed)
        folder = tmp_path_factory.mktemp(f"checkpoint-{name}")
        model.save_pretrained(folder, safe_serialization=True)
        folders[name] = (str(folder), model, hf_greedy(model, PROMPT, NEW_TOKENS, None).token_ids)
    assert folders["a"][2] != folders["b"][2] != folders["c"][2]  # the checkpoints answer differently
    return folders


def greedy(served: Served) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{served.base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def served(checkpoints: dict[str, Any]) -> Iterator[Served]:
    with serving(checkpoints["a"][0], *FLAGS, env=DEV) as served:
        yield served


def test_an_update_serves_the_new_checkpoint_and_requests_follow_the_pause_mode(
    served: Served, checkpoints: dict[str, Any]
) -> None:
    assert greedy(served) == checkpoints["a"][2]
    info = httpx.get(f"{served.base}/weight_info").json()
    assert info["world_size"] == 1 and info["group"] is None and info["num_updates"] == 0
    aborted = httpx.post(f"{served.base}/abort_requests", json={"request_ids": ["none-such"]}, timeout=30)
    assert aborted.status_code == 200  # vLLM's dev-mode route for RL loops
    client = WeightTransferClient(served.base, timeout_s=30)
    group = client.init()
    assert group == {"backend": "gloo", "ranks": [1], "world_size": 2}
    # mode abort: new requests are refused until the update ends
    client.start("abort")
    refused = httpx.post(
        f"{served.base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60
    )
    assert refused.status_code == 503
    assert httpx.get(f"{served.base}/weight_info").json()["updating"]
    with pytest.raises(WeightTransferError, match="open already"):
        client.start("abort")
    with pytest.raises(WeightTransferError, match="lacks"):  # an empty update: refused, and dropped
        client.finish()
    assert greedy(served) == checkpoints["a"][2]
    # mode keep: a request that comes during the update waits, and is answered by the new weights
    client.start("keep")
    waiting: list[list[int]] = []
    thread = threading.Thread(target=lambda: waiting.append(greedy(served)))
    thread.start()
    wait_until(lambda: _waiting(served) == 1, 30, "the request to queue")
    client.update(checkpoints["b"][1].named_parameters(), buffer_bytes=64 << 10)
    done = client.finish(version="step-1")
    thread.join(timeout=60)
    assert waiting == [checkpoints["b"][2]]  # the new weights, as HF transformers answers with them
    assert done["weight_version"] == "step-1" and done["num_updates"] == 1 and not done["updating"]
    assert greedy(served) == checkpoints["b"][2]
    unpacked = client.send(checkpoints["c"][1].state_dict().items(), packed=False)
    assert unpacked["num_updates"] == 2 and greedy(served) == checkpoints["c"][2]


def _waiting(served: Served) -> int:
    for line in httpx.get(f"{served.base}/metrics").text.splitlines():
        if line.startswith("engine:num_requests_waiting"):
            return int(float(line.split()[-1]))
    return 0


@pytest.mark.long  # a failure drill across processes
def test_a_trainer_that_dies_mid_update_leaves_the_served_weights(
    served: Served, checkpoints: dict[str, Any]
) -> None:
    before = greedy(served)
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER, served.base, checkpoints["a"][0], "die"],
        cwd=pathlib.Path(__file__).parent.parent, timeout=180, env={**os.environ},
    )  # fmt: skip
    assert trainer.returncode == 3

    def settled() -> dict[str, Any] | None:
        info: dict[str, Any] = httpx.get(f"{served.base}/weight_info").json()
        return info if not info["updating"] and info["last_error"] else None

    info = wait_until(settled, 90, "the failed update to be dropped")
    assert not info["is_paused"]
    assert greedy(served) == before  # the old weights serve on
    trainer = subprocess.run([sys.executable, "-c", TRAINER, served.base, checkpoints["a"][0], "send"],
                             cwd=pathlib.Path(__file__).parent.parent, timeout=180)  # fmt: skip
    assert trainer.returncode == 0 and greedy(served) == checkpoints["a"][2]
    assert httpx.get(f"{served.base}/weight_info").json()["weight_version"] == "from-a-process"


@pytest.mark.long  # two worker ranks and an engine of their own
def test_every_rank_of_a_tp_2_engine_gets_its_shard(checkpoints: dict[str, Any]) -> None:
    with serving(checkpoints["a"][0], *FLAGS, "-tp", "2", env=DEV) as served:
        assert greedy(served) == checkpoints["a"][2]
        client = WeightTransferClient(served.base, timeout_s=30)
        assert client.init() == {"backend": "gloo", "ranks": [1, 2], "world_size": 3}
        client.send(checkpoints["b"][1].named_parameters())
        assert greedy(served) == checkpoints["b"][2]


@pytest.mark.long  # two servers for two refusals
def test_routes_need_the_config_and_dev_mode(checkpoints: dict[str, Any]) -> None:
    with serving(checkpoints["a"][0], *FLAGS[:-2], env=DEV) as served:
        answer = httpx.get(f"{served.base}/weight_info")
        assert answer.status_code == 400 and "--weight-transfer-config" in answer.text
    with serving(checkpoints["a"][0], *FLAGS) as served:
        assert httpx.get(f"{served.base}/weight_info").status_code == 404
