"""Build a generation engine whose shards all run in this process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from cluster.config import ModelConfig, load_model_config
from cluster.decode.engine import GenerationEngine
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.prefix_index import PrefixIndex
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.model.fast_path import DecodeFastPath
from cluster.model.loading import load_shard
from cluster.model.shard import shard_specs


@dataclass
class LocalEngine:
    engine: GenerationEngine
    config: ModelConfig
    worker: MLXWorker
    runners: list[ShardRunner]

    def close(self) -> None:
        self.worker.close()


async def open_local_engine(
    model_dir: str | Path,
    *,
    ranges: list[tuple[int, int]] | None = None,
    mtp: bool = True,
    dtype: mx.Dtype | None = None,
    prefill_chunk: int = 512,
    prefix_index: PrefixIndex | None = None,
    prefix_budget_bytes: int | None = None,
    fast_path: DecodeFastPath | None = None,
) -> LocalEngine:
    """With `prefix_index`, the engine keeps a conversation cache (each shard's snapshots
    within `prefix_budget_bytes`). Every shard steps with `fast_path` (None: the device's
    default, `DecodeFastPath.for_device()`)."""
    config = load_model_config(model_dir)
    specs = shard_specs(ranges or [(0, config.num_layers)])
    if specs[-1].end != config.num_layers or specs[0].start != 0:
        raise ValueError(f"layer ranges must cover [0, {config.num_layers})")
    worker = MLXWorker()
    runners = []
    for spec in specs:
        shard = await worker.run(
            load_shard, model_dir, spec, dtype=dtype, mtp=mtp, for_decoding=True,
            fast_path=fast_path,
        )  # fmt: skip
        runners.append(ShardRunner(shard, prefix_budget_bytes=prefix_budget_bytes))
    pipeline = LocalPipeline(runners, worker, max_context=config.max_context)
    return LocalEngine(
        GenerationEngine(pipeline, prefill_chunk=prefill_chunk, prefix_index=prefix_index),
        config,
        worker,
        runners,
    )
