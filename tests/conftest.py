"""Shared fixtures: the bundled model, its tokenizer, and the engine's greedy reference."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cluster.config import bundled_model_path
from cluster.decode.engine import GenerationOutput, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions

T = TypeVar("T")

# Tests stop daemons with Ctrl-C (SIGINT) and check that they say goodbye on the way out. A
# shell starting the test run in the background (`... &`) leaves SIGINT ignored, and an ignored
# signal stays ignored across exec: every daemon would ignore its Ctrl-C. A handler does not
# survive exec, so with one here the daemons start with SIGINT at its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

CODE_PROMPTS = (
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "# Parse command line arguments\nimport argparse\n\nparser = ",
)
REFERENCE_TOKENS = 64  # each of `greedy_reference`'s outputs


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return load_tokenizer(model_dir)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def arun() -> Callable[[Coroutine[Any, Any, T]], T]:
    return run


@pytest.fixture(scope="session")
def greedy_reference(model_dir: Path, tokenizer) -> dict[bool, list[GenerationOutput]]:
    """The engine in one process, greedy, MTP off and on (by that key): the outputs of
    CODE_PROMPTS one request at a time, REFERENCE_TOKENS each. What the pipeline's nodes and
    the engine's other paths must give; computed once for every module that compares with it."""

    async def generate(mtp: bool) -> list[GenerationOutput]:
        local = await open_local_engine(model_dir, mtp=mtp)
        try:
            stop = frozenset(local.config.eos_token_ids)
            outputs = []
            for prompt in CODE_PROMPTS:
                request = GenerationRequest(
                    tuple(tokenizer.encode(prompt)), REFERENCE_TOKENS, RequestOptions(mtp=mtp), stop
                )
                outputs.append(await local.engine.generate(request))
            assert all(not runner.requests for runner in local.runners), "state leaked"
            return outputs
        finally:
            local.close()

    return {mtp: run(generate(mtp)) for mtp in (False, True)}


def greedy_tokens(outputs: list[GenerationOutput], max_tokens: int) -> list[tuple[int, ...]]:
    """The first `max_tokens` of each of `greedy_reference`'s outputs: greedy decoding makes
    them the tokens of a request for that many."""
    assert all(len(output.tokens) >= max_tokens for output in outputs)
    return [output.tokens[:max_tokens] for output in outputs]
