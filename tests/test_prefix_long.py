"""The conversation cache at long lengths and across conversations, on three node daemons.

Chat prompts are rendered by the coordinator's own template code (`render_chat_prompt`), which
marks where the system block and the last message end; the engine keeps snapshots there. A
6000-token conversation's next turn starts from its history's snapshot; a second conversation
with the same 3000-token system prompt starts from that prompt's snapshot; an exact repeat
starts from the last message's end; a prompt that re-tokenizes differently across a cached end
starts from the boundary before it. Every output is compared with a cold full prefill of the
same prompt on a cache-less engine over the same nodes, greedy with MTP off and seeded with
MTP on. A lookup that finds nothing is counted by its reason.
"""

from __future__ import annotations

import json

import nodes
import pytest
from conftest import CODE_PROMPTS
from nodes import NodeGroup

from cluster.decode.engine import GenerationEngine, GenerationOutput, GenerationRequest
from cluster.decode.prefix_index import (
    EVICTED,
    NEVER_STORED,
    REPEAT,
    RETOKENIZED,
    PrefixIndex,
)
from cluster.decode.remote_pipeline import PipelineSettings, load_pipeline
from cluster.messages import RequestOptions, SamplingParams
from coordinator.chat_prompt import render_chat_prompt
from coordinator.chat_request import parse_chat_request

node_factory = nodes.node_factory  # the fixture, for this module

ANSWER_TOKENS = 6
GREEDY = RequestOptions(mtp=False)
SEEDED = RequestOptions(sampling=SamplingParams(temperature=0.8, seed=11), mtp=True)


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3)


def _text_of(tokenizer, tokens: int) -> str:
    """Python source of at least `tokens` tokens."""
    piece = "\n\n".join(CODE_PROMPTS) + "\n\n"
    text = piece
    while len(tokenizer.encode(text)) < tokens:
        text += piece
    return text


def _chat(tokenizer, messages: list[dict], options: RequestOptions) -> GenerationRequest:
    body = json.dumps({"messages": messages}).encode()
    prompt = render_chat_prompt(tokenizer, parse_chat_request(body, model_id="m", max_context=8192))
    return GenerationRequest(prompt.tokens, ANSWER_TOKENS, options, boundaries=prompt.boundaries)


async def _same_as_cold(
    cached: GenerationEngine, plain: GenerationEngine, request: GenerationRequest
) -> GenerationOutput:
    out = await cached.generate(request)
    cold = await plain.generate(request)
    assert out.tokens == cold.tokens
    return out


def test_long_and_shared_prefixes_hit(trio, model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        pipeline = await load_pipeline(model_dir, trio.addresses, PipelineSettings(trio.token))
        try:
            index = PrefixIndex()
            cached = GenerationEngine(pipeline, prefix_index=index)
            plain = GenerationEngine(pipeline)  # the same nodes, no cache: a cold prefill
            system = {"role": "system", "content": _text_of(tokenizer, 3000)}
            history = [system, {"role": "user", "content": _text_of(tokenizer, 3050)}]
            # A 6000-token conversation (MTP on: its snapshots serve requests with and
            # without drafts).
            opening = _chat(tokenizer, history, RequestOptions())
            assert len(opening.prompt) > 6000 and opening.boundaries[0] >= 3000
            first = await cached.generate(opening)
            assert first.cached_tokens == 0
            # Another conversation with the same system prompt: only what follows is new.
            other = _chat(tokenizer, [system, {"role": "user", "content": "Explain."}], SEEDED)
            second = await _same_as_cold(cached, plain, other)
            assert second.cached_tokens >= 3000
            assert second.cached_tokens == opening.boundaries[0]
            # The first conversation's next turn starts after its 6000-token history.
            answer = tokenizer.decode(list(first.tokens))
            turn = [*history, {"role": "assistant", "content": answer}]
            turn.append({"role": "user", "content": "And a queue?"})
            following = await _same_as_cold(cached, plain, _chat(tokenizer, turn, GREEDY))
            assert following.cached_tokens >= 6000
            # Exact repeats start from the last message's end, greedy and seeded.
            again = await cached.generate(_chat(tokenizer, turn, GREEDY))
            assert again.tokens == following.tokens
            assert again.cached_tokens >= len(_chat(tokenizer, turn, GREEDY).prompt) - 8
            repeat = await cached.generate(other)
            assert repeat.tokens == second.tokens and repeat.cached_tokens > 3000
            assert index.stats.hits == 4 and index.stats.fallbacks == 0
            assert sum(index.stats.misses.values()) == 1  # the opening
        finally:
            await pipeline.close()

    arun(scenario())


def test_retokenized_cut_and_miss_reasons(trio, model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        pipeline = await load_pipeline(model_dir, trio.addresses, PipelineSettings(trio.token))
        try:
            index = PrefixIndex(capacity=3)
            cached = GenerationEngine(pipeline, prefix_index=index)
            plain = GenerationEngine(pipeline)
            head = tuple(tokenizer.encode(CODE_PROMPTS[1] + "\n\n"))
            text = CODE_PROMPTS[2] + "    return self.it"
            longer = text + "ems()\n"
            cut = tuple(tokenizer.encode(text))
            joined = tuple(tokenizer.encode(longer))
            assert joined[: len(cut)] != cut  # the text re-tokenizes across the cut
            for options in (GREEDY, SEEDED):
                index.stats.misses = dict.fromkeys(index.stats.misses, 0)
                # With a boundary after `head`: the next prompt re-tokenized across the old
                # prompt's end still starts at the boundary.
                await cached.generate(
                    GenerationRequest(head + cut, ANSWER_TOKENS, options, boundaries=(len(head),))
                )
                out = await _same_as_cold(
                    cached, plain, GenerationRequest(head + joined, ANSWER_TOKENS, options)
                )
                assert out.cached_tokens == len(head)
                # Without boundaries: a miss, and why.
                await cached.generate(GenerationRequest(cut, ANSWER_TOKENS, options))
                out = await _same_as_cold(
                    cached, plain, GenerationRequest(joined, ANSWER_TOKENS, options)
                )
                assert out.cached_tokens == 0
                assert index.stats.misses[RETOKENIZED] == 1
                repeat = await cached.generate(GenerationRequest(cut, ANSWER_TOKENS, options))
                assert index.stats.misses[REPEAT] == 1  # the prompt's end leaves nothing
                sibling = (*cut, 13 if repeat.tokens[0] != 13 else 14)
                fresh = tuple(tokenizer.encode(CODE_PROMPTS[3]))
                await cached.generate(GenerationRequest(fresh, ANSWER_TOKENS, options))
                # The capacity of 3 evicted `cut`'s end since: its sibling misses for that.
                await cached.generate(GenerationRequest(sibling, ANSWER_TOKENS, options))
                assert index.stats.misses[EVICTED] == 1
                assert index.stats.misses[NEVER_STORED] >= 2  # `cut`, `fresh`
        finally:
            await pipeline.close()

    arun(scenario())
