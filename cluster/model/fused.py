"""Projections that read the same input fused into one matmul each, at load.

On a GPU every op of a decode step costs host time (Python builds its graph node, the backend
launches its kernel) and is one more link in the chain of dependent kernels the device runs. A
decoder layer projects its normed input several times over: GatedDeltaNet by q/k/v, z, b and
a; attention by q, k and v; the MLP by gate and up. Each group becomes one matmul over the
weights concatenated along the output axis, whose output is split again. Quantized weights
concatenate the same way (quantization groups run along the input axis), so every output
column is computed from exactly the weights it was before.

Applied by `load_shard(..., for_decoding=True)` to the lazily loaded weights, before they are
evaluated: the parts are read straight into the fused array and freed, a layer at a time, so
a load peaks at the shard's own bytes (`tests/test_loading.py`). The parameter names change
(`linear_attn.in_proj.proj.*`), so a shard that is written back out (`cluster convert`) is
loaded unfused.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_5 import MLP

__all__ = ["FusedMLP", "FusedProjection", "fuse_projections"]

Projection = nn.Linear | nn.QuantizedLinear


class FusedProjection(nn.Module):
    """Several linear maps of one input as one matmul; the call returns their outputs."""

    def __init__(self, proj: Projection, sizes: tuple[int, ...]):
        super().__init__()
        self.proj = proj
        self.sizes = sizes
        self._splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.proj(x), self._splits, axis=-1)


class FusedMLP(nn.Module):
    """mlx-lm's Qwen3.5 MLP with gate and up as one matmul."""

    def __init__(self, gate_up: FusedProjection, down_proj: Projection):
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_up(x)
        return self.down_proj(swiglu(gate, up))


def _signature(module: nn.Module) -> tuple | None:
    """What must agree for linear maps to share one matmul (None: not a plain linear map)."""
    if type(module) is nn.QuantizedLinear:
        quant = (module.group_size, module.bits, module.mode, module.biases is not None)
    elif type(module) is nn.Linear:
        quant = None
    else:
        return None
    dtypes = tuple((k, v.dtype) for k, v in sorted(module.items()) if isinstance(v, mx.array))
    width = module.weight.shape[1]
    return type(module), quant, dtypes, width, "bias" in module


def fuse(parts: list[Projection]) -> FusedProjection | None:
    """One projection computing `parts` side by side, or None if they cannot share a matmul."""
    signature = _signature(parts[0])
    if signature is None or any(_signature(p) != signature for p in parts[1:]):
        return None
    first = parts[0]
    names = [k for k, v in first.items() if isinstance(v, mx.array)]
    if isinstance(first, nn.QuantizedLinear):
        # The smallest valid instance (its random init is one group); the weights replace it.
        proj: Projection = nn.QuantizedLinear(
            first.group_size, 1, bias="bias" in first, group_size=first.group_size,
            bits=first.bits, mode=first.mode,
        )  # fmt: skip
    else:
        proj = nn.Linear(1, 1, bias="bias" in first)
    for name in names:
        setattr(proj, name, mx.concatenate([p[name] for p in parts], axis=0))
    if isinstance(proj, nn.QuantizedLinear):
        proj.freeze()
    return FusedProjection(proj, tuple(p.weight.shape[0] for p in parts))


def fuse_projections(module: nn.Module) -> int:
    """Fuse the projections of every decoder layer under `module` (a shard: its layers and its
    MTP head's) in place; returns how many groups were fused. Layers whose parts differ in
    type or quantization keep them apart."""
    from cluster.model.layers import PackedDecoderLayer

    fused = 0
    for _, layer in module.named_modules():
        if not isinstance(layer, PackedDecoderLayer):
            continue
        if layer.is_linear:
            gdn = layer.linear_attn
            names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            if (proj := fuse([getattr(gdn, n) for n in names])) is not None:
                for name in names:
                    delattr(gdn, name)
                gdn.in_proj = proj
                fused += 1
        else:
            attn = layer.self_attn
            names = ("q_proj", "k_proj", "v_proj")
            if (proj := fuse([getattr(attn, n) for n in names])) is not None:
                for name in names:
                    delattr(attn, name)
                attn.qkv_proj = proj
                fused += 1
        mlp = layer.mlp
        if type(mlp) is MLP and (proj := fuse([mlp.gate_proj, mlp.up_proj])) is not None:
            layer.mlp = FusedMLP(proj, mlp.down_proj)
            fused += 1
    return fused
