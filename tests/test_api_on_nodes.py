"""What the API asks of the tail, across three node daemons: top logprobs and the JSON
grammar's token masks travel the pipeline (the tail is another process) and give what the
in-process engine gives, with MTP drafting."""

from __future__ import annotations

import json

import nodes
import pytest
from nodes import NodeGroup, remote_engine

from cluster.decode.engine import (
    GenerationChunk,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
)
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions
from coordinator.response_format import JsonGrammars
from tests.fakes import EOS, tokenizer

node_factory = nodes.node_factory  # the fixture, for this module

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
OPTIONS = RequestOptions(logprobs=True, top_logprobs=4)


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3)


async def _run(engine: GenerationEngine) -> tuple[GenerationOutput, list[GenerationChunk]]:
    messages = [{"role": "user", "content": "Show me the source of json"}]
    prompt = tuple(tokenizer().apply_chat_template(messages, add_generation_prompt=True))
    constraint = JsonGrammars(tokenizer(), [EOS]).constraint(SCHEMA)
    request = GenerationRequest(prompt, 48, OPTIONS, frozenset({EOS}), constraint=constraint)
    chunks: list[GenerationChunk] = []
    output = await engine.generate(request, chunks.append)
    return output, chunks


def test_logprobs_and_json_masks_across_nodes(trio, model_dir, arun) -> None:
    async def remote() -> tuple[GenerationOutput, list[GenerationChunk]]:
        async with remote_engine(model_dir, trio.addresses) as (engine, _):
            return await _run(engine)

    async def local() -> tuple[GenerationOutput, list[GenerationChunk]]:
        engine = await open_local_engine(model_dir)
        try:
            return await _run(engine.engine)
        finally:
            engine.close()

    (far, far_chunks), (near, near_chunks) = arun(remote()), arun(local())
    assert far.tokens == near.tokens and far.finish_reason == "stop" and far.drafted > 0
    value = json.loads(tokenizer().decode(list(far.tokens)))
    assert set(value) == {"name", "n"} and value["n"] in (1, 2, 3)
    far_top = [top for c in far_chunks for top in c.top_logprobs or ()]
    near_top = [top for c in near_chunks for top in c.top_logprobs or ()]
    assert len(far_top) == len(far.tokens)
    for a, b in zip(far_top, near_top, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-3)
