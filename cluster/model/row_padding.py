"""Quantized matmuls over a few rows, padded to the row count MLX CUDA runs cheapest.

MLX CUDA's 4-bit quantized matmul pays per row from 2 to 7 rows and takes a GEMM path from 8
rows on that costs what one row costs (17408x5120: 0.079 ms at 1 row, 0.138 at 2, 0.058 at 8;
/work/shared/MEASUREMENTS.md). So a verify step `[y, d]` could run its projections on 8 rows:
the real rows padded with zero rows whose outputs are dropped (attention and the recurrences
keep the real length). Each row of a matmul depends on its own input row alone, so padding
never changes what the real rows compute.

Measured on the whole step it does not pay (BENCHMARKS.md, issue 10: the 27B-shape verify
step took 44.6 ms padded against 37.6 ms unpadded on an H200): the step is bound by the host,
and the padding's own ops (zeros, concatenate, slice: three more graph nodes and launches per
projection) cost more host time than the GEMM path saves on the device. So it is off on every
backend; `install` plus `set_enabled(True)` turn it on (the benchmark's A/B run, the tests).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = ["PAD_TO", "RowPaddedQuantizedLinear", "enabled", "install", "set_enabled"]

PAD_TO = 8  # MLX CUDA's quantized matmul takes its GEMM path from 8 rows on

_override: bool | None = None


def set_enabled(on: bool | None) -> None:
    """Turn padding on or off for the installed projections (None: the default, off)."""
    global _override
    _override = on


def enabled() -> bool:
    return bool(_override)


class RowPaddedQuantizedLinear(nn.QuantizedLinear):
    """mlx's QuantizedLinear, run on `PAD_TO` rows when it is called on fewer than that
    (but more than one) and padding is enabled."""

    def __call__(self, x: mx.array) -> mx.array:
        width = x.shape[-1]
        rows = x.size // width if width else 0
        if not 1 < rows < PAD_TO or not enabled():
            return super().__call__(x)
        flat = x.reshape(rows, width)
        padded = mx.concatenate([flat, mx.zeros((PAD_TO - rows, width), dtype=x.dtype)])
        out = super().__call__(padded)[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def install(module: nn.Module) -> int:
    """Make every QuantizedLinear under `module` a RowPaddedQuantizedLinear, in place (same
    parameters, same names); returns how many."""
    count = 0
    for _, child in module.named_modules():
        if type(child) is nn.QuantizedLinear:
            # The subclass adds no state, so the instance can simply take its class.
            child.__class__ = RowPaddedQuantizedLinear
            count += 1
    return count
