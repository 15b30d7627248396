"""`cluster generate`: one prompt through the engine, locally or over node daemons."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cluster.config import load_model_config
from cluster.decode.engine import GenerationChunk, GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions
from cluster.model.shard import parse_layers


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str, chat: bool) -> tuple[int, ...]:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(tokenizer.encode(prompt))


async def run_generate(
    model_dir: Path,
    prompt: str,
    *,
    chat: bool,
    max_tokens: int,
    options: RequestOptions,
    layers: str | None = None,
    nodes: str | None = None,
    token: str | None = None,
    tls_cert: str | None = None,
    stream_to: TextIO | None = None,
) -> dict:
    config = load_model_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ids = encode_prompt(tokenizer, prompt, chat)
    stop = frozenset(config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    request = GenerationRequest(ids, max_tokens, options, stop)
    ranges = parse_layers(layers) if layers else None
    if nodes:
        from cluster.transport.auth import TLSConfig
        from cluster.transport.node_client import open_remote_engine

        remote = await open_remote_engine(
            model_dir,
            nodes.split(","),
            token=token,
            ranges=ranges,
            tls=TLSConfig.from_files(tls_cert),
        )
        try:
            return await _run(remote.engine, tokenizer, request, stream_to)
        finally:
            await remote.close()
    local = await open_local_engine(model_dir, ranges=ranges, mtp=options.mtp)
    try:
        return await _run(local.engine, tokenizer, request, stream_to)
    finally:
        local.close()


async def _run(
    engine: GenerationEngine,
    tokenizer: TokenizerWrapper,
    request: GenerationRequest,
    stream_to: TextIO | None,
) -> dict:
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
    }
