"""The pipeline across real node processes on loopback gives the single-process engine's tokens.

One trio of `cluster node` processes serves the whole module; each test loads the layout it
needs with LoadShard. The reference is the engine of `cluster.decode.local_engine` in this process
(conftest's `greedy_reference`). The nodes build their plain decode steps ahead
(`--build-ahead on`: on the CPU, on a `HostLateInput`), as they do on CUDA by default.
"""

from __future__ import annotations

import asyncio
import math

import nodes
import pytest
from checkpoints import make_checkpoint
from conftest import CODE_PROMPTS, REFERENCE_TOKENS, run
from nodes import NodeGroup, active_requests, node_infos, remote_engine

from cluster.decode.engine import GenerationEngine, GenerationOutput, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions, SamplingParams
from cluster.model.shard import even_ranges
from proto import cluster_pb2 as pb

node_factory = nodes.node_factory  # the fixture, for this module

MAX_TOKENS = REFERENCE_TOKENS  # as the reference's outputs have
NUM_LAYERS = 8  # the bundled model's


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3, args=lambda _: ["--build-ahead", "on"])


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(p)) for p in CODE_PROMPTS]


def _request(prompt, *, mtp: bool, seed: int | None = None, max_tokens: int = MAX_TOKENS):
    sampling = SamplingParams() if seed is None else SamplingParams(0.8, top_p=0.95, seed=seed)
    return GenerationRequest(prompt, max_tokens, RequestOptions(sampling, mtp=mtp))


async def _local_outputs(model_dir, requests: list[GenerationRequest]) -> list[GenerationOutput]:
    local = await open_local_engine(model_dir)
    try:
        return [await local.engine.generate(r) for r in requests]
    finally:
        local.close()


async def _generate_each(
    engine: GenerationEngine, addresses: list[str], requests: list[GenerationRequest]
) -> list[GenerationOutput]:
    """One request after the other; after each, no node holds any state of it."""
    outputs = []
    for request in requests:
        outputs.append(await engine.generate(request))
        assert await active_requests(addresses) == [0] * len(addresses), "state left on a node"
    return outputs


def _assert_same(outputs: list[GenerationOutput], expected: list[GenerationOutput]) -> None:
    assert [o.tokens for o in outputs] == [e.tokens for e in expected]
    assert all(len(o.tokens) == MAX_TOKENS for o in outputs)
    # The same drafts were made and accepted: every node rolled back exactly as the local one.
    assert [(o.drafted, o.accepted) for o in outputs] == [(e.drafted, e.accepted) for e in expected]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_nodes_give_the_single_process_tokens(
    count, trio, model_dir, prompts, greedy_reference
) -> None:
    addresses = trio.addresses[:count]

    async def go() -> tuple[dict[bool, list[GenerationOutput]], list[pb.NodeInfo]]:
        ranges = even_ranges(NUM_LAYERS, count)
        async with remote_engine(model_dir, addresses, ranges=ranges) as (engine, _):
            outputs = {
                mtp: await _generate_each(
                    engine, addresses, [_request(p, mtp=mtp) for p in prompts]
                )
                for mtp in (False, True)
            }
            return outputs, await node_infos(addresses)

    outputs, infos = run(go())
    for info in infos:  # where each node's decode steps went, phase by phase
        phases = info.step_phases
        assert phases.layers_ms > 0 and phases.handoff_ms > 0 and phases.send_ms > 0
        assert min(phases.queued_ms, phases.decode_ms, phases.encode_ms) >= 0
        # MTP off, each node built nearly every decode step ahead, and ran most of them as
        # built. One whose message came later than AHEAD_WAIT_S was released and undone:
        # a few on an idle machine, about a third with 4 test workers on 2 cores.
        decode_steps = len(prompts) * (MAX_TOKENS - 8)
        assert info.steps_ahead_used + info.steps_ahead_undone >= decode_steps
        assert info.steps_ahead_used >= decode_steps // 2
    _assert_same(outputs[False], greedy_reference[False])
    _assert_same(outputs[True], greedy_reference[True])
    assert all(o.drafted == 0 for o in outputs[False])
    drafted = sum(o.drafted for o in outputs[True])
    accepted = sum(o.accepted for o in outputs[True])
    assert drafted > accepted > 0  # drafts were rejected (and rolled back) as well as accepted


def test_moe_checkpoints_across_three_nodes(trio, tmp_path_factory, prompts) -> None:
    """A MoE model in the raw Hugging Face layout, both layouts of the MTP layer's experts."""
    requests = [_request(p, mtp=mtp) for mtp in (False, True) for p in prompts[:2]]
    tokens = {}
    for layout in ("per_expert", "fused"):
        model_dir = make_checkpoint(tmp_path_factory.mktemp(layout), moe=True, mtp_experts=layout)

        async def go(model_dir=model_dir) -> list[GenerationOutput]:
            async with remote_engine(model_dir, trio.addresses) as (engine, _):
                return await _generate_each(engine, trio.addresses, requests)

        outputs = run(go())
        _assert_same(outputs, run(_local_outputs(model_dir, requests)))
        # Random weights: the MTP head's drafts are all rejected, so every decode step of
        # these requests is rolled back on every node (accepts are covered by the bundled model).
        assert sum(o.drafted for o in outputs) > 0
        tokens[layout] = [o.tokens for o in outputs]
    assert tokens["per_expert"] == tokens["fused"]  # one seed, one model, two layouts


def test_a_rejection_costs_no_extra_message(trio, model_dir, prompts) -> None:
    """Every node receives exactly the driver's messages: one per prefill chunk and one per
    decode step, rejected drafts included; no standalone Rollback is ever sent."""
    chunk = 16
    prompt = tuple(t for p in prompts for t in p)
    request = _request(prompt, mtp=True)

    async def go():
        async with remote_engine(model_dir, trio.addresses, prefill_chunk=chunk) as (engine, pl):
            rollbacks = []
            for client in pl.clients:
                rpc = client.stub.Rollback

                def spy(*args, rpc=rpc, **kwargs):
                    rollbacks.append(args)
                    return rpc(*args, **kwargs)

                client.stub.Rollback = spy
            before = [info.steps_total for info in await node_infos(trio.addresses)]
            chunks = []
            output = await engine.generate(request, chunks.append)
            after = [info.steps_total for info in await node_infos(trio.addresses)]
            received = [b - a for a, b in zip(before, after, strict=True)]
            return output, len(chunks), pl.messages_sent, received, rollbacks

    output, n_chunks, sent, received, rollbacks = run(go())
    (expected,) = run(_local_outputs(model_dir, [request]))
    assert output.tokens == expected.tokens
    assert output.drafted > output.accepted > 0  # rejections happened in this request
    prefill_messages = math.ceil(len(prompt) / chunk)
    assert prefill_messages > 1
    assert sent == prefill_messages + (n_chunks - 1)  # the first chunk came from the prefill
    assert received == [sent] * 3
    assert rollbacks == []


def test_concurrent_greedy_requests_give_their_own_tokens(
    trio, model_dir, prompts, greedy_reference
):
    requests = [_request(p, mtp=True) for p in prompts]
    assert len(requests) >= 4

    async def go():
        arrivals: list[int] = []
        async with remote_engine(model_dir, trio.addresses) as (engine, _):
            outputs = await asyncio.gather(
                *(
                    engine.generate(r, lambda _chunk, i=i: arrivals.append(i))
                    for i, r in enumerate(requests)
                )
            )
            assert await active_requests(trio.addresses) == [0, 0, 0]
        return outputs, arrivals

    outputs, arrivals = run(go())
    _assert_same(outputs, greedy_reference[True])
    # In flight together: every request had emitted before any of them emitted its last chunk.
    last_first = max(arrivals.index(i) for i in range(len(requests)))
    first_last = min(len(arrivals) - 1 - arrivals[::-1].index(i) for i in range(len(requests)))
    assert last_first < first_last


def test_concurrent_sampled_requests_match_alone(
    trio, model_dir, prompts, greedy_reference
) -> None:
    requests = [_request(p, mtp=True, seed=1234 + i, max_tokens=48) for i, p in enumerate(prompts)]

    async def go():
        async with remote_engine(model_dir, trio.addresses) as (engine, _):
            alone = [await engine.generate(r) for r in requests]
            together = await asyncio.gather(*(engine.generate(r) for r in requests))
            assert await active_requests(trio.addresses) == [0, 0, 0]
        return alone, together

    alone, together = run(go())
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert sum(o.drafted for o in alone) > 0
    # Sampling happened: not every output is the greedy one.
    greedy = [o.tokens[:48] for o in greedy_reference[True]]
    assert [o.tokens for o in alone] != greedy
    # And a seeded request gives the same tokens in one process.
    assert [o.tokens for o in run(_local_outputs(model_dir, requests))] == [o.tokens for o in alone]
