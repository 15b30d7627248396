"""Which parts of the decode fast path a shard runs: one frozen choice, made at load.

Each part computes what the plain ops compute; the tests hold each to that (bit for bit on
the CPU, greedy text up to ties for the CUDA kernels). A shard takes its `DecodeFastPath` when
it is built (`ModelShard`, `cluster.model.loading.load_shard`, `open_local_engine`) and its
layers read the fields on every step, so two shards of one process may run different choices
side by side (the tests' reference against the fast path; a benchmark's A/B rounds).

`DecodeFastPath.for_device()` is the default, per backend:
- on MLX CUDA everything is on: there a decode step is bound by the host (each op of a step's
  graph costs a dispatch), and the compiled steps, the kernels and the padded rows each take
  ops or per-row cost out of it;
- on Metal only mlx-lm's own fused recurrence kernel runs (the rest is not measured to pay
  there, and nothing is turned on where it may cost);
- on the CPU nothing: its compiler runs cost seconds, and its quantized matmul is linear in
  rows, so padding only adds work.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cluster.model.row_padding import PAD_FROM, PAD_TO

__all__ = ["DecodeFastPath"]


@dataclass(frozen=True, slots=True)
class DecodeFastPath:
    """The fast path's parts a shard runs.

    - `compiled_steps`: a GatedDeltaNet step of one request of at most
      `compiled_steps.MAX_COMPILED_POSITIONS` positions runs its recurrence (`gdn_core`) as
      one compiled call (`cluster.model.compiled_steps`);
    - `compiled_layers`: such a step of one request, or of a batch whose requests' steps share
      one shape, runs the whole GatedDeltaNet decoder layer as one compiled call;
    - `compiled_batches`: a batch of several requests of mixed shapes runs each group's
      recurrence as one compiled call;
    - `even_steps`: a batch whose requests' steps differ in length (drafts beside none) runs
      them padded to one length (`cluster.model.even_steps`), as a batch of one shape;
    - `pad_rows_from`: a dense shard's steps of this many rows up to `PAD_TO` run their
      projections, norms and MLPs on `PAD_TO` rows (`cluster.model.row_padding`); None: never;
    - `few_row_kernel`: the quantized projections run the few-row and tensor-core kernels
      (`cluster.model.few_row_matmul`; applied at load, on CUDA only);
    - `recurrence_kernel`: GatedDeltaNet's recurrence runs the backend's fused kernel
      (mlx-lm's on Metal, `cluster.model.gated_delta_kernel` on CUDA), where it takes the step.
    """

    compiled_steps: bool = False
    compiled_layers: bool = False
    compiled_batches: bool = False
    even_steps: bool = False
    pad_rows_from: int | None = None
    few_row_kernel: bool = False
    recurrence_kernel: bool = False

    def __post_init__(self) -> None:
        if self.pad_rows_from is not None and not 1 <= self.pad_rows_from <= PAD_TO:
            raise ValueError(f"pad_rows_from must be None or 1..{PAD_TO}, got {self.pad_rows_from}")

    @classmethod
    def for_device(cls) -> DecodeFastPath:
        """The default for MLX's default device now (see the module's docstring)."""
        gpu = mx.default_device() == mx.gpu
        cuda = gpu and mx.cuda.is_available()
        metal = gpu and mx.metal.is_available()
        return cls(
            compiled_steps=cuda,
            compiled_layers=cuda,
            compiled_batches=cuda,
            even_steps=cuda,
            pad_rows_from=PAD_FROM if cuda else None,
            few_row_kernel=cuda,
            recurrence_kernel=cuda or metal,
        )

    @classmethod
    def plain(cls) -> DecodeFastPath:
        """None of it: every step runs the plain ops (the tests' reference)."""
        return cls()

    @classmethod
    def everything(cls, *, pad_rows_from: int | None = PAD_FROM) -> DecodeFastPath:
        """Every part on, wherever the backend can run it (the CUDA kernels on CUDA only)."""
        return cls(True, True, True, True, pad_rows_from, True, True)
