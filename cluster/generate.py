"""One prompt through the engine, in this process or over node daemons (what `cluster
generate` runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cluster.config import load_model_config
from cluster.decode.engine import GenerationChunk, GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions
from cluster.transport.auth import TLSConfig


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str, chat: bool) -> tuple[int, ...]:
    """The prompt's token ids; with `chat`, as the user's message in the chat template, the
    assistant's turn opened."""
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(tokenizer.encode(prompt))


@dataclass(frozen=True, slots=True)
class Shards:
    """Where the model's shards run: its layers split as `ranges` (None: evenly), on the node
    daemons at `addresses` (head first, reached with the cluster `token` and `tls`) or, with
    no addresses, in this process."""

    ranges: list[tuple[int, int]] | None = None
    addresses: tuple[str, ...] = ()
    token: str = field(default="", repr=False)
    tls: TLSConfig | None = None


async def run_generate(
    model_dir: Path,
    prompt: str,
    *,
    chat: bool,
    max_tokens: int,
    options: RequestOptions,
    shards: Shards = Shards(),
    stream_to: TextIO | None = None,
    warmup: bool = True,
) -> dict:
    """Generate for `prompt` (in the model's chat template with `chat`) at most `max_tokens`
    tokens, where `shards` says (this process, or node daemons). The text goes to `stream_to`
    as it comes; the result holds the text, the token ids, the prompt's length, the MTP drafts
    made and accepted, the decode rate, and `warmup_s`.

    With `warmup`, a synthetic request of the same prompt length and MTP setting runs first
    (cluster.decode.warmup.plan_for_request), untimed: the rate and the time to the first token
    are then those of a warm engine, not of one building its kernels (`warmup_s`: how long
    that took; 0 without)."""
    config = load_model_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ids = encode_prompt(tokenizer, prompt, chat)
    stop = frozenset(config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    request = GenerationRequest(ids, max_tokens, options, stop)
    warm = config.text.vocab_size if warmup else None
    if shards.addresses:
        from cluster.decode.remote_pipeline import PipelineSettings, open_remote_engine

        settings = PipelineSettings(shards.token, tls=shards.tls, ranges=shards.ranges)
        remote = await open_remote_engine(model_dir, list(shards.addresses), settings)
        try:
            return await _run(remote.engine, tokenizer, request, stream_to, warm)
        finally:
            await remote.close()
    local = await open_local_engine(model_dir, ranges=shards.ranges, mtp=options.mtp)
    try:
        return await _run(local.engine, tokenizer, request, stream_to, warm)
    finally:
        local.close()


async def _run(
    engine: GenerationEngine,
    tokenizer: TokenizerWrapper,
    request: GenerationRequest,
    stream_to: TextIO | None,
    warm_vocab_size: int | None,
) -> dict:
    """`request` on `engine`, after a warm-up of its shapes where `warm_vocab_size` (the
    model's vocabulary, for the synthetic prompt) is given."""
    warmup_s = 0.0
    if warm_vocab_size is not None:
        from cluster.decode.warmup import WarmupProgress, plan_for_request, run_warmup

        pipeline = engine.pipeline
        progress = WarmupProgress()
        await run_warmup(
            pipeline,
            plan_for_request(request, pipeline.max_context),
            prefill_chunk=engine.prefill_chunk,
            vocab_size=warm_vocab_size,
            progress=progress,
        )
        warmup_s = progress.seconds
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()

    def show(chunk: GenerationChunk) -> None:
        for token in chunk.tokens:
            detokenizer.add_token(token)
        stream_to.write(detokenizer.last_segment)
        stream_to.flush()

    output = await engine.generate(request, show if stream_to is not None else None)
    if stream_to is not None:
        detokenizer.finalize()
        stream_to.write(detokenizer.last_segment)
    return {
        "text": tokenizer.decode(list(output.tokens)),
        "tokens": list(output.tokens),
        "prompt_tokens": output.prompt_tokens,
        "drafted": output.drafted,
        "accepted": output.accepted,
        "generation_tps": output.generation_tps,
        "time_to_first_token_s": output.time_to_first_token_s,
        "warmup_s": warmup_s,
    }
