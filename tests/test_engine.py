"""The engine in one process: greedy identity with and without MTP, and with mlx-lm."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from conftest import CODE_PROMPTS, REFERENCE_TOKENS, run
from mlx.utils import tree_map
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate

from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestError, RequestOptions

MAX_TOKENS = REFERENCE_TOKENS  # as the plain and with_mtp outputs have


async def _generate_all(
    model_dir, prompts, *, mtp: bool, ranges=None, concurrent=False, fast_path=None
):
    local = await open_local_engine(model_dir, ranges=ranges, mtp=mtp, fast_path=fast_path)
    try:
        stop = frozenset(local.config.eos_token_ids)
        requests = [
            GenerationRequest(tuple(p), MAX_TOKENS, RequestOptions(mtp=mtp), stop) for p in prompts
        ]
        if concurrent:
            outs = await asyncio.gather(*(local.engine.generate(r) for r in requests))
        else:
            outs = [await local.engine.generate(r) for r in requests]
        assert all(not runner.requests for runner in local.runners), "state leaked"
        return outs
    finally:
        local.close()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in CODE_PROMPTS]


@pytest.fixture(scope="module")
def plain(greedy_reference):
    return greedy_reference[False]


@pytest.fixture(scope="module")
def with_mtp(greedy_reference):
    return greedy_reference[True]


def test_greedy_mtp_matches_plain_decoding(plain, with_mtp) -> None:
    for a, b in zip(plain, with_mtp, strict=True):
        assert a.tokens == b.tokens
        assert len(a.tokens) == MAX_TOKENS
    drafted = sum(o.drafted for o in with_mtp)
    accepted = sum(o.accepted for o in with_mtp)
    # Both outcomes of verification were exercised, and the head is the trained one.
    assert 0 < accepted < drafted
    assert accepted / drafted > 0.4
    assert all(o.drafted == 0 for o in plain)


def test_greedy_matches_mlx_lm_stream_generate(model_dir, tokenizer, prompts, with_mtp) -> None:
    model, _ = mlx_lm_load(str(model_dir))
    for prompt, ours in zip(prompts, with_mtp, strict=True):
        theirs = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)]
        assert list(ours.tokens) == theirs


def test_concurrent_requests_batch_to_the_same_tokens(model_dir, prompts, with_mtp) -> None:
    together = run(_generate_all(model_dir, prompts, mtp=True, concurrent=True))
    assert [o.tokens for o in together] == [o.tokens for o in with_mtp]


def test_shards_in_sequence_match_the_whole_model(model_dir, prompts, with_mtp) -> None:
    split = run(_generate_all(model_dir, prompts, mtp=True, ranges=[(0, 3), (3, 8)]))
    assert [o.tokens for o in split] == [o.tokens for o in with_mtp]


def test_small_prefill_chunks_give_the_same_tokens(model_dir, prompts, with_mtp) -> None:
    async def go():
        local = await open_local_engine(model_dir)
        engine = GenerationEngine(local.engine.pipeline, prefill_chunk=3)
        try:
            stop = frozenset(local.config.eos_token_ids)
            return [
                await engine.generate(GenerationRequest(tuple(p), MAX_TOKENS, stop_tokens=stop))
                for p in prompts
            ]
        finally:
            local.close()

    assert [o.tokens for o in run(go())] == [o.tokens for o in with_mtp]


class _ChunkRecorder:
    """A pipeline that records the prefill steps it passes on (steps of more than one
    confirmed position, or at position 0), and the most of a request's steps in it at once."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.prefill_sizes: dict[str, list[int]] = {}
        self.in_flight: dict[str, int] = {}
        self.most_in_flight: dict[str, int] = {}

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

    async def submit(self, step):
        request = step.request_id.split(".")[0]
        if step.n_confirmed > 1 or step.position == 0:
            self.prefill_sizes.setdefault(request, []).append(len(step.tokens))
        self.in_flight[request] = self.in_flight.get(request, 0) + 1
        most = max(self.most_in_flight.get(request, 0), self.in_flight[request])
        self.most_in_flight[request] = most
        try:
            return await self.pipeline.submit(step)
        finally:
            self.in_flight[request] -= 1

    async def release(self, request_id: str) -> None:
        await self.pipeline.release(request_id)


def _prefill_beside_a_decode(model_dir, prompts, decode_tokens: int):
    """A 40-token prompt alone, then again once another request (of `decode_tokens` tokens)
    has its first token; prefill chunk 16, interleave chunk 4. The recorder, both answers."""

    async def go():
        local = await open_local_engine(model_dir)
        recorder = _ChunkRecorder(local.engine.pipeline)
        engine = GenerationEngine(recorder, prefill_chunk=16)
        engine.interleave_chunk = 4
        engine.pacer.adaptive = False  # the chunk's size is not what this looks at
        long_prompt = (tuple(prompts[1]) * 8)[:40]
        try:
            alone = await engine.generate(GenerationRequest(long_prompt, 8, request_id="alone"))
            first_token = asyncio.Event()

            async def decode() -> None:
                request = GenerationRequest(tuple(prompts[0]), decode_tokens, request_id="other")
                async for _ in engine.stream(request):
                    first_token.set()

            running = asyncio.create_task(decode())
            await first_token.wait()
            joined = await engine.generate(GenerationRequest(long_prompt, 8, request_id="joined"))
            await running
            return recorder, alone.tokens, joined.tokens
        finally:
            local.close()

    return run(go())


def test_a_prompt_arriving_while_others_decode_prefills_in_interleave_chunks(
    model_dir, prompts
) -> None:
    """Alone, a prompt goes in `prefill_chunk` chunks, submitted together; while another
    request decodes, in `interleave_chunk` ones, one at a time (a decode step then meets at
    most one chunk in the pipeline); the tokens are the same either way."""
    recorder, alone, joined = _prefill_beside_a_decode(model_dir, prompts, decode_tokens=64)
    assert recorder.prefill_sizes["alone"] == [16, 16, 8]
    assert recorder.prefill_sizes["joined"] == [4] * 10
    assert recorder.most_in_flight["alone"] == 3 and recorder.most_in_flight["joined"] == 1
    assert alone == joined


def test_a_prompt_in_interleave_chunks_goes_on_in_whole_ones_once_no_other_decodes(
    model_dir, prompts
) -> None:
    """The request it made way for ends after a token: the rest of the prompt needs no
    small chunks one at a time any more (they cost its first token one pipeline round each)."""
    recorder, alone, joined = _prefill_beside_a_decode(model_dir, prompts, decode_tokens=2)
    sizes = recorder.prefill_sizes["joined"]
    assert sizes[0] == 4 and sum(sizes) == 40
    assert max(sizes) == 16 and len(sizes) < 10, sizes  # the rest in chunks of 16
    assert recorder.most_in_flight["joined"] > 1  # ... submitted together
    assert alone == joined


class _SlowChunks(_ChunkRecorder):
    """A pipeline on which the "joined" request's prefill chunks take `chunk_s` each, and a
    step that arrives meanwhile waits for the chunk, as a decode step batched with a chunk
    does on a node."""

    def __init__(self, pipeline, chunk_s: float) -> None:
        super().__init__(pipeline)
        self.chunk_s = chunk_s
        self.busy = asyncio.Lock()

    async def submit(self, step):
        async with self.busy:
            if step.request_id.startswith("joined"):
                await asyncio.sleep(self.chunk_s)
        return await super().submit(step)


def test_a_prompt_arriving_while_others_decode_shortens_chunks_that_stall_them(
    model_dir, prompts
) -> None:
    """Chunks that make the decoding request wait many of its steps are halved as the
    prompt goes on (the pacer reads the request's gaps), and the answer is the same."""

    async def go():
        local = await open_local_engine(model_dir)
        pipeline = _SlowChunks(local.engine.pipeline, chunk_s=0.3)
        engine = GenerationEngine(pipeline, prefill_chunk=16)
        long_prompt = (tuple(prompts[1]) * 50)[:200]
        try:
            alone = await engine.generate(GenerationRequest(long_prompt, 8, request_id="alone"))
            decoded, done = asyncio.Event(), asyncio.Event()

            async def decode() -> None:
                request = GenerationRequest(tuple(prompts[0]), 1000, request_id="other")
                tokens = 0
                async for chunk in engine.stream(request):
                    tokens += len(chunk.tokens)
                    if tokens >= 12:  # its quiet gaps are known
                        decoded.set()
                    if done.is_set():
                        return

            running = asyncio.create_task(decode())
            await decoded.wait()
            joined = await engine.generate(GenerationRequest(long_prompt, 8, request_id="joined"))
            done.set()
            await running
            return pipeline.prefill_sizes["joined"], alone.tokens, joined.tokens, engine.pacer
        finally:
            local.close()

    sizes, alone, joined, pacer = run(go())
    assert sizes[0] == 16 and sum(sizes) == 200
    assert min(sizes) < 16 and pacer.trace[0].before == 16 and pacer.trace[0].ratio > 2.4
    assert alone == joined


def test_the_interleave_chunk_is_the_longest_within_the_budget() -> None:
    from cluster.decode.warmup import INTERLEAVE_BUDGET, choose_interleave_chunk

    step = 0.020
    timed = {16: 0.021, 64: 0.025, 256: INTERLEAVE_BUDGET * step * 1.01, 512: 0.1}
    assert choose_interleave_chunk(step, timed) == 64
    assert choose_interleave_chunk(step, {16: 1.0, 64: 2.0}) == 16  # none fits: the shortest


def test_prompt_longer_than_the_context_is_refused(model_dir) -> None:
    async def go() -> None:
        local = await open_local_engine(model_dir)
        try:
            too_long = tuple([5] * local.engine.max_context)
            with pytest.raises(RequestError, match="exceeds the context"):
                await local.engine.generate(GenerationRequest(too_long, 8))
        finally:
            local.close()

    run(go())


def test_bad_generation_requests_are_refused() -> None:
    with pytest.raises(RequestError, match="empty"):
        GenerationRequest((), 8)
    with pytest.raises(RequestError, match="max_tokens"):
        GenerationRequest((1, 2), 0)


@pytest.mark.parametrize(
    ("mtp_experts", "tied"), [("per_expert", False), ("fused", False), ("per_expert", True)]
)
def test_moe_checkpoint_greedy_identity(tmp_path, mtp_experts: str, tied: bool) -> None:
    """MoE in both MTP-expert layouts (and tied embeddings): MTP on == MTP off == mlx-lm."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "moe", moe=True, mtp_experts=mtp_experts,
                           tie_word_embeddings=tied)  # fmt: skip
    prompts = [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    plain = run(_generate_all(path, prompts, mtp=False))
    spec = run(_generate_all(path, prompts, mtp=True))
    split = run(_generate_all(path, prompts, mtp=True, ranges=[(0, 1), (1, 4)]))
    assert [o.tokens for o in plain] == [o.tokens for o in spec] == [o.tokens for o in split]
    assert sum(o.drafted for o in spec) > 0
    model, tokenizer = mlx_lm_load(str(path))
    _experts_in_float32(model)  # as our loader does on the CPU backend
    for prompt, ours in zip(prompts, plain, strict=True):
        out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)]
        assert list(ours.tokens) == out[: len(ours.tokens)]


def _experts_in_float32(model) -> None:
    """MLX's CPU gather_mm (the MoE experts) supports float32 only."""
    if mx.default_device() != mx.cpu:
        return
    for layer in model.layers:
        experts = getattr(layer.mlp, "switch_mlp", None)
        if experts is not None:
            experts.update(tree_map(lambda a: a.astype(mx.float32), experts.parameters()))


def test_logprobs_are_the_models_own(model_dir, tokenizer) -> None:
    """Asked for, logprobs come with each token (MTP on or off) and match a plain forward."""
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))

    async def go(mtp: bool):
        local = await open_local_engine(model_dir, mtp=mtp)
        try:
            request = GenerationRequest(prompt, 12, RequestOptions(mtp=mtp, logprobs=True))
            tokens, logprobs = [], []
            async for chunk in local.engine.stream(request):
                tokens += chunk.tokens
                logprobs += chunk.logprobs
            return tokens, logprobs
        finally:
            local.close()

    tokens, logprobs = run(go(True))
    assert run(go(False))[0] == tokens and len(logprobs) == len(tokens) == 12
    model, _ = mlx_lm_load(str(model_dir))
    logits = model(mx.array([*prompt, *tokens[:-1]])[None])[0, len(prompt) - 1 :]
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[
        mx.arange(12), mx.array(tokens)
    ]
    assert all(abs(a - b) < 0.05 for a, b in zip(logprobs, expected.tolist(), strict=True))
    assert all(lp <= 0 for lp in logprobs)
