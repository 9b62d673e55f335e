"""Shared fixtures: models load once per session; nothing is ever downloaded."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def llama():
    from probes import Engine

    return Engine.from_id("tiny-random:llama")


@pytest.fixture(scope="session")
def moe():
    from probes import Engine

    return Engine.from_id("tiny-random:qwen3_moe")


@pytest.fixture(scope="session")
def smollm2():
    from probes import Engine

    return Engine.from_id("smollm2-135m")
