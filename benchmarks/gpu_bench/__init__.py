"""GPU figures at a real model's shape with random weights: one process, N nodes, mlx-lm.

    python -m benchmarks.gpu_bench --shape qwen3_5_27b --bits 4 --json $OUT/gpu.json
    python -m benchmarks.gpu_bench --shape tiny --json /tmp/gpu-tiny.json   # CPU smoke run

1. Writes a random-weight checkpoint of the shape (Qwen3.5-27B: 64 layers, hidden 5120, vocab
   248320, untied lm_head, one MTP layer; `benchmarks.random_checkpoint`). The logits of a
   prompt are checked to be finite.
2. In this process, on one MLX worker thread: the copy bandwidth; `ShardRunner.run` over the
   whole model for a plain one-token step and for a verify step `[y, d]` (MTP head included),
   medians of synchronised steps after warm-up, and a breakdown (graph building vs evaluation of
   the backbone, lm_head, MTP head); then decode tokens/s through the engine with MTP off, and
   on with the acceptance oracle of `benchmarks.oracle_node` (each draft accepted with
   probability alpha: random weights make real acceptance meaningless, the oracle keeps every
   real cost: MTP head, 2-token step, snapshots, rollbacks); then mlx-lm's `stream_generate` on
   the same directory.
3. 2 and 3 local node processes on the same device (`python -m benchmarks.oracle_node`),
   driven through `cluster.decode.remote_pipeline.open_remote_engine`: decode tokens/s with MTP
   off and on, as ratios to the single-process engine of the same run.
4. mlx-lm's own pipeline (`model.model.pipeline(group)`) under `mlx.launch --backend ring` with
   2 ranks on 127.0.0.1; if it fails as is, the exact error is recorded and it runs again with
   its send/recv/all_gather on the CPU stream (the ring backend's own implementation).

`--interleave N` measures the fast path's `--variants` side by side instead, in N rounds on one
loaded shard with their order reversed every other round (the host drifts within minutes);
`--diagnose` measures where a step loses time, the primitives of its graph among them.

Decode tokens/s is tokens after the first over the time after the first (the engine's
`generation_tps`; for mlx-lm the same quantity from its responses' time stamps). Greedy; stop
tokens ignored, so every run decodes exactly --tokens tokens. Phases that would not finish
before --deadline-s are skipped and say so; the JSON is rewritten after every phase.

The parts, one a module: `step_timing` (steps and their parts timed on the MLX thread),
`one_process` (the engine and mlx-lm in this process, the fast path's variants),
`node_processes` (oracle nodes, one per GPU), `side_by_side` (the paired rounds), `mlx_ring`
(mlx-lm's pipeline), `diagnosis` (`--diagnose`, with `split_step`'s halves of a step),
`summary` (the closing table); `run` puts the phases in order within their `phase` deadlines.
"""
