"""The conversation (prefix) cache: a turn that extends a cached one prefills only the new part.

On three node daemons: the second turn of a conversation starts from the snapshot every node
kept at the end of the first answer, so the positions the nodes compute drop to the new suffix
(counted on the nodes), and the greedy output is the same as without the cache, with MTP on or
off. A prefix that one node no longer holds falls back to a full prefill with the same output;
snapshots evicted for a node's budget or the index's capacity are dropped on every node. The
coordinator reports it in `usage.prompt_tokens_details.cached_tokens`, /metrics and the
dashboard's document. In-process shards give the same answers as a cache-less engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nodes
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import CODE_PROMPTS
from mlx_lm.tokenizer_utils import load as load_tokenizer
from nodes import NodeGroup, node_infos

from cluster.decode.engine import GenerationEngine, GenerationOutput, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.prefix_index import (
    EVICTED,
    NEVER_STORED,
    OVER_BUDGET,
    REPEAT,
    RETOKENIZED,
    PrefixEntry,
    PrefixIndex,
)
from cluster.decode.remote_pipeline import PipelineSettings, RemotePipeline, load_pipeline
from cluster.messages import RequestError, RequestOptions, StepRequest
from cluster.transport.node_client import NodeClient
from coordinator.admission import AdmissionController
from coordinator.api import Monitoring, ServedModel, create_app
from coordinator.discovery import NodeDirectory
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings

node_factory = nodes.node_factory  # the fixture, for this module

ANSWER_TOKENS = 12
NO_MTP = RequestOptions(mtp=False)


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3)


def _turns(tokenizer, first: GenerationOutput, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The second turn: the first prompt, its answer, and a new question."""
    return prompt + first.tokens + tuple(tokenizer.encode("\n\nclass Queue:\n"))


async def _positions(addresses: list[str]) -> list[int]:
    return [info.positions_computed for info in await node_infos(addresses)]


async def _snapshot_counts(addresses: list[str]) -> list[int]:
    return [info.prefix_snapshots for info in await node_infos(addresses)]


async def _settled(condition, what: str, deadline_s: float = 10.0) -> None:
    """Drops travel in the background: wait for them, with a deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await condition():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _cached_pipeline(model_dir: Path, trio: NodeGroup, **load: int) -> RemotePipeline:
    return await load_pipeline(model_dir, trio.addresses, PipelineSettings(trio.token, **load))


# ---- on three node daemons ------------------------------------------------------------------


def test_second_turn_prefills_only_the_new_suffix(trio, model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        pipeline = await _cached_pipeline(model_dir, trio)
        try:
            index = PrefixIndex()
            cached = GenerationEngine(pipeline, prefix_index=index)
            plain = GenerationEngine(pipeline)  # the same shards, no cache
            first_prompt = tuple(tokenizer.encode(CODE_PROMPTS[1]))
            for options in (NO_MTP, RequestOptions()):
                first = await cached.generate(
                    GenerationRequest(first_prompt, ANSWER_TOKENS, options)
                )
                assert first.cached_tokens == 0
                second_prompt = _turns(tokenizer, first, first_prompt)
                reference = await plain.generate(
                    GenerationRequest(second_prompt, ANSWER_TOKENS, options)
                )
                before = await _positions(trio.addresses)
                second = await cached.generate(
                    GenerationRequest(second_prompt, ANSWER_TOKENS, options)
                )
                after = await _positions(trio.addresses)
                assert second.tokens == reference.tokens
                # The answer's last token was never fed: the snapshot ends just before it (with
                # MTP, a bonus token cut by max_tokens was fed, and the snapshot holds it).
                fed = len(first_prompt) + len(first.tokens)
                assert fed - 1 <= second.cached_tokens <= fed
                if options.mtp:
                    continue
                assert second.cached_tokens == fed - 1
                suffix = len(second_prompt) - second.cached_tokens
                decode = len(second.tokens) - 1  # one position per step without MTP
                assert [b - a for a, b in zip(before, after, strict=True)] == [suffix + decode] * 3
            assert index.stats.hits == 2 and index.stats.fallbacks == 0
        finally:
            await pipeline.close()

    arun(scenario())


def test_prefix_missing_on_one_node_falls_back_to_a_full_prefill(
    trio, model_dir, tokenizer, arun
) -> None:
    async def scenario() -> None:
        pipeline = await _cached_pipeline(model_dir, trio)
        try:
            index = PrefixIndex()
            cached = GenerationEngine(pipeline, prefix_index=index)
            plain = GenerationEngine(pipeline)
            first_prompt = tuple(tokenizer.encode(CODE_PROMPTS[2]))
            first = await cached.generate(GenerationRequest(first_prompt, ANSWER_TOKENS, NO_MTP))
            second_prompt = _turns(tokenizer, first, first_prompt)
            entry = index.longest(second_prompt, False)
            assert entry is not None and entry.length > len(first_prompt)
            # The middle node loses the answer's snapshot; the index does not know yet.
            middle = NodeClient(trio.addresses[1], trio.token)
            try:
                assert await middle.drop_prefix_snapshots([entry.snapshot_id]) == 1
            finally:
                await middle.close()
            reference = await plain.generate(
                GenerationRequest(second_prompt, ANSWER_TOKENS, NO_MTP)
            )
            before = await _positions(trio.addresses)
            second = await cached.generate(GenerationRequest(second_prompt, ANSWER_TOKENS, NO_MTP))
            after = await _positions(trio.addresses)
            assert second.tokens == reference.tokens
            assert second.cached_tokens == 0 and index.stats.fallbacks == 1
            assert not index.holds(second_prompt[: entry.length], mtp=False)
            # The tail never computed the abandoned start: a full prefill, and the decode.
            assert after[2] - before[2] == len(second_prompt) + len(second.tokens) - 1
        finally:
            await pipeline.close()

    arun(scenario())


def test_evicted_prefixes_are_dropped_on_every_node(trio, model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        first_prompt = tuple(tokenizer.encode(CODE_PROMPTS[3]))
        # A node budget that no snapshot fits: every one is dropped, output unchanged.
        pipeline = await _cached_pipeline(model_dir, trio, prefix_budget_bytes=1)
        try:
            index = PrefixIndex()
            cached = GenerationEngine(pipeline, prefix_index=index)
            plain = GenerationEngine(pipeline)
            first = await cached.generate(GenerationRequest(first_prompt, ANSWER_TOKENS, NO_MTP))
            second_prompt = _turns(tokenizer, first, first_prompt)
            second = await cached.generate(GenerationRequest(second_prompt, ANSWER_TOKENS, NO_MTP))
            reference = await plain.generate(
                GenerationRequest(second_prompt, ANSWER_TOKENS, NO_MTP)
            )
            assert second.tokens == reference.tokens and second.cached_tokens == 0
            assert len(index) == 0 and await _snapshot_counts(trio.addresses) == [0, 0, 0]
            assert index.stats.misses[OVER_BUDGET] == 1  # the second turn: nothing fit
        finally:
            await pipeline.close()
        # A budget for a few snapshots (fewer on the head, whose layers' states are the
        # largest): each node evicts its least recently used, and what one node dropped goes
        # from the index and every node.
        pipeline = await _cached_pipeline(model_dir, trio, prefix_budget_bytes=700_000)
        try:
            index = PrefixIndex()
            cached = GenerationEngine(pipeline, prefix_index=index)
            for text in CODE_PROMPTS:
                prompt = tuple(tokenizer.encode(text))
                await cached.generate(GenerationRequest(prompt, 4, NO_MTP))
            assert 1 <= len(index) < 2 * len(CODE_PROMPTS)

            async def as_many_as_indexed() -> bool:
                return await _snapshot_counts(trio.addresses) == [len(index)] * 3

            await _settled(
                as_many_as_indexed, "the index's snapshots, and only those, on every node"
            )
            second = await cached.generate(GenerationRequest(second_prompt, ANSWER_TOKENS, NO_MTP))
            assert second.tokens == reference.tokens
        finally:
            await pipeline.close()
        # The index's capacity: the least recently used entries go from every node.
        pipeline = await _cached_pipeline(model_dir, trio)
        try:
            index = PrefixIndex(capacity=2)
            cached = GenerationEngine(pipeline, prefix_index=index)
            for text in CODE_PROMPTS[:3]:
                prompt = tuple(tokenizer.encode(text))
                await cached.generate(GenerationRequest(prompt, 4, NO_MTP))
            assert len(index) == 2

            async def two_everywhere() -> bool:
                return await _snapshot_counts(trio.addresses) == [2, 2, 2]

            await _settled(two_everywhere, "two snapshots on every node")
        finally:
            await pipeline.close()

    arun(scenario())


def test_coordinator_reports_cached_tokens(trio, model_dir, arun) -> None:
    async def scenario() -> None:
        coordinator = Coordinator(
            CoordinatorSettings(model_dir, trio.token, use_all=True, serve_weights=False),
            NodeDirectory(trio.addresses, browse=False),
        )
        await coordinator.start(wait_for_nodes_s=20)
        app = create_app(
            coordinator.engine,
            load_tokenizer(model_dir),
            coordinator,
            served=ServedModel(model_dir.name),
            admission=AdmissionController(max_running=2, max_queued=4, queue_timeout_s=10),
            monitoring=Monitoring(coordinator.counters),
        )
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            messages = [{"role": "user", "content": "Show me the source of a stack"}]
            # Greedy: a sampled answer that began with a newline would re-tokenize differently
            # in the next turn (merged with the template's newline), and miss the cache there.
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            pipeline = coordinator.pipeline
            first = await (await client.post("/v1/chat/completions", json=body)).json()
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, first
            # The ends of the prompt and of the answer, indexed before the response ended.
            index = coordinator.engine.engine.prefix_index
            assert len(index) == 2
            answer = first["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And a queue?"},
            ]
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            second = await (await client.post("/v1/chat/completions", json=body)).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            # (A re-placement in between, after a missed heartbeat, would start a new index.)
            assert coordinator.pipeline is pipeline, "the model was re-placed between the turns"
            # At least the first prompt, which every node kept at its end.
            assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"], (
                first,
                second,
                index.stats,
            )
            metrics = await (await client.get("/metrics")).text()
            assert "cluster_prefix_cache_hits_total 1\n" in metrics
            assert 'cluster_prefix_cache_misses_total{reason="never_stored"} 1\n' in metrics
            assert 'cluster_prefix_cache_misses_total{reason="evicted"} 0\n' in metrics
            assert f"cluster_prefix_cache_saved_tokens_total {cached}\n" in metrics
            document = await (await client.get("/api/cluster")).json()
            assert document["stats"]["prefix_cache_hits"] == 1
            assert document["stats"]["prefix_cache_saved_tokens"] == cached
            assert document["stats"]["prefix_cache_misses"]["never_stored"] == 1
            # Each node's share: what it holds (the coordinator heard it on its last poll).
            infos = await node_infos(trio.addresses)
            assert all(info.prefix_snapshots == len(index) for info in infos)
            assert 'cluster_node_prefix_snapshot_bytes{node="' in metrics
        finally:
            await client.close()
            await coordinator.close()

    arun(scenario())


# ---- in process -----------------------------------------------------------------------------


def test_in_process_shards_give_the_cacheless_tokens(model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        ranges = [(0, 3), (3, 5), (5, 8)]
        cached = await open_local_engine(
            model_dir, ranges=ranges, prefix_index=PrefixIndex(), prefill_chunk=16
        )
        plain = await open_local_engine(model_dir, ranges=ranges, prefill_chunk=16)
        try:
            prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
            options = RequestOptions(logprobs=True, mtp_depth=2)
            first = await cached.engine.generate(GenerationRequest(prompt, ANSWER_TOKENS, options))
            # The second turn and a sibling of the first (from the prompt's own snapshot).
            for follow in (_turns(tokenizer, first, prompt), (*prompt, 13)):
                request = GenerationRequest(follow, ANSWER_TOKENS, options)
                cached_logprobs: list[float] = []
                plain_logprobs: list[float] = []
                again = await cached.engine.generate(
                    request, lambda chunk, out=cached_logprobs: out.extend(chunk.logprobs)
                )
                reference = await plain.engine.generate(
                    request, lambda chunk, out=plain_logprobs: out.extend(chunk.logprobs)
                )
                assert again.tokens == reference.tokens
                assert cached_logprobs == plain_logprobs  # to the bit
                assert again.cached_tokens >= len(prompt)
        finally:
            cached.close()
            plain.close()

    arun(scenario())


def test_index_finds_the_longest_usable_prefix() -> None:
    index = PrefixIndex(capacity=2)
    assert index.add(PrefixEntry.of((1, 2), 11, mtp=False)) == []
    assert index.add(PrefixEntry.of((1, 2, 3, 4), 12, mtp=True)) == []
    assert index.longest((1, 2, 3, 4, 5), mtp=True).snapshot_id == 12
    assert index.longest((1, 2, 3, 4, 5), mtp=False).snapshot_id == 12
    assert index.longest((1, 2, 3, 9), mtp=True) is None  # no MTP state in the shorter one
    assert index.longest((2, 1, 3), mtp=False) is None
    assert index.longest((1, 2, 3, 4), mtp=False).snapshot_id == 11  # leaves a token to compute
    assert index.holds((1, 2), mtp=False) and not index.holds((1, 2), mtp=True)
    # (1, 2) was used last: the capacity evicts (1, 2, 3, 4).
    assert index.add(PrefixEntry.of((7,), 13, mtp=False)) == [12]
    index.forget([11])
    assert index.longest((1, 2, 3), mtp=False) is None and len(index) == 1
    assert index.add(PrefixEntry.of((1, 2), 11, mtp=False)) == [11]  # a dropped id stays dropped


def test_index_says_why_a_lookup_missed() -> None:
    index = PrefixIndex(capacity=2)
    assert index.lookup((1, 2, 3), mtp=False).miss == NEVER_STORED
    index.add(PrefixEntry.of((1, 2, 3), 11, mtp=False))
    assert index.lookup((1, 2, 3), mtp=False).miss == REPEAT  # nothing left to compute
    assert index.lookup((1, 2), mtp=False).miss == REPEAT
    assert index.lookup((1, 2, 3, 4), mtp=True).miss == NEVER_STORED  # no MTP state in it
    long = tuple(range(100, 140))
    index.add(PrefixEntry.of(long, 12, mtp=True))
    # The same text re-tokenized near the entry's end.
    assert index.lookup((*long[:-2], 7, 8, 9), mtp=False).miss == RETOKENIZED
    assert index.lookup((*long[:5], 7, 8, 9), mtp=False).miss == NEVER_STORED  # too early
    index.add(PrefixEntry.of((5, 6), 13, mtp=False))  # the capacity evicts (1, 2, 3)
    assert index.lookup((1, 2, 3, 4), mtp=False).miss == EVICTED
    index.forget([13])  # a shard dropped the entry added last: it did not fit there
    assert index.lookup((5, 6, 7), mtp=False).miss == OVER_BUDGET
    assert index.add(PrefixEntry.of((5, 6), 13, mtp=False)) == [13]
    assert index.lookup((*long, 1), mtp=True).entry.snapshot_id == 12
    assert index.stats.lookups == 9  # 8 misses and a hit (counted by the engine)
    assert index.stats.misses == {
        EVICTED: 1, OVER_BUDGET: 1, RETOKENIZED: 1, REPEAT: 2, NEVER_STORED: 3
    }  # fmt: skip


def test_snapshot_memory_is_kv_by_length_plus_a_fixed_state(model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        local = await open_local_engine(model_dir, prefix_index=PrefixIndex(), prefill_chunk=64)
        try:
            prompt = tuple(tokenizer.encode(CODE_PROMPTS[0] * 20))
            for length in (40, 80):
                await local.engine.generate(GenerationRequest(prompt[:length], 1, NO_MTP))
            for runner in local.runners:
                short, long = (s.cache for s in runner.snapshots._snapshots.values())
                assert (short.position, long.position) == (40, 80)
                assert long.state_nbytes == short.state_nbytes > 0
                assert long.kv_nbytes == 2 * short.kv_nbytes > 0
                assert short.nbytes == short.kv_nbytes + short.state_nbytes
        finally:
            local.close()

    arun(scenario())


def test_prefill_is_cut_at_boundaries_that_keep_snapshots(model_dir, tokenizer, arun) -> None:
    async def scenario() -> None:
        ranges = [(0, 3), (3, 5), (5, 8)]
        cached = await open_local_engine(
            model_dir, ranges=ranges, prefix_index=PrefixIndex(), prefill_chunk=16
        )
        plain = await open_local_engine(model_dir, ranges=ranges, prefill_chunk=16)
        try:
            index = cached.engine.prefix_index
            prompt = tuple(tokenizer.encode(CODE_PROMPTS[0] + CODE_PROMPTS[1] * 3))
            options = RequestOptions(mtp_depth=2)
            # Boundaries inside chunks, the first of three dropped (at most two are kept).
            request = GenerationRequest(prompt, ANSWER_TOKENS, options, boundaries=(5, 21, 30))
            await cached.engine.generate(request)
            assert index.holds(prompt[:5], mtp=True) and index.holds(prompt[:30], mtp=True)
            assert not index.holds(prompt[:21], mtp=True) and not index.holds(prompt, mtp=True)
            for follow in ((*prompt[:5], 77, 78), (*prompt[:30], 9), prompt):
                request = GenerationRequest(follow, ANSWER_TOKENS, options)
                again = await cached.engine.generate(request)
                reference = await plain.engine.generate(request)
                assert again.tokens == reference.tokens
                assert again.cached_tokens == (5 if len(follow) < 30 else 30)
        finally:
            cached.close()
            plain.close()

    arun(scenario())


def test_steps_name_snapshots_only_where_they_can_be() -> None:
    with pytest.raises(RequestError, match="position > 0"):
        StepRequest("r", (1, 2), 0, prefix_from=5)
    with pytest.raises(RequestError, match="without drafts"):
        StepRequest("r", (1, 2), 7, draft_len=1, prefix_save=5)


def test_index_keys_are_exact_for_any_token_id() -> None:
    index = PrefixIndex()
    index.add(PrefixEntry.of((151643, 5), 21, mtp=False))
    assert index.longest((151643, 5, 9), mtp=False).length == 2
    assert index.longest((151643, 6, 9), mtp=False) is None
    assert index.longest((151643 + 256, 5, 9), mtp=False) is None  # differs in a high byte
