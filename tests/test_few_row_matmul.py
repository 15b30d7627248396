"""The few-row quantized matmul (`cluster.model.few_row_matmul`) and, for a batch's 4 to 32
rows at 4 bits, the tensor-core one (`cluster.model.tensor_core_matmul`).

Everywhere: which linear maps take it, that they keep their arrays, that where the kernel does
not run they compute exactly what `nn.QuantizedLinear` does, and that a shard whose
`DecodeFastPath` leaves the kernel out keeps MLX's layers. Where MLX runs on CUDA (the kernel
itself; run there with `python -m pytest tests/test_few_row_matmul.py`): the kernel against
a float32 reference and MLX's own kernel, each row independent of the rows beside it, and
greedy decoding at 4 bits identical with the kernel and without, with MTP (rejected drafts
rolled back) and without, on the bundled model and a MoE fixture, but at a tie: the kernel
rounds its float sums as MLX's kernel does but in another order (tests/greedy_ties.py).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import CODE_PROMPTS
from greedy_ties import assert_greedy_identical_with

from cluster.model import few_row_matmul, tensor_core_matmul
from cluster.model.convert import convert
from cluster.model.fast_path import DecodeFastPath
from cluster.model.few_row_matmul import (
    FewRowQuantizedLinear,
    few_row_quantized_matmul,
    use_few_row_kernel,
    use_mlx_kernels,
)
from cluster.model.loading import load_shard
from cluster.model.tensor_core_matmul import tensor_core_quantized_matmul

on_cuda = pytest.mark.skipif(
    not few_row_matmul.available(), reason="the kernel runs on MLX's CUDA backend only"
)


def _quantized(
    k: int, n: int, *, bits: int = 4, group_size: int = 64, bias: bool = False, dtype=mx.bfloat16
):
    layer = nn.QuantizedLinear.from_linear(nn.Linear(k, n, bias=bias), group_size, bits)
    layer.update({k: v.astype(dtype) for k, v in layer.items() if k != "weight"})
    return layer


def _input(layer: nn.Module) -> mx.array:
    quantized = isinstance(layer, nn.QuantizedLinear)
    width = layer.weight.shape[1] * 32 // layer.bits if quantized else layer.weight.shape[1]
    return mx.random.normal((1, 3, width)).astype(layer.scales.dtype if quantized else mx.float32)


def test_eligible_layers_are_swapped_over_their_own_arrays() -> None:
    model = nn.Module()
    model.q4 = _quantized(256, 70, bias=True)
    model.q8 = _quantized(128, 33, bits=8, group_size=128)
    model.narrow = _quantized(96, 8, group_size=32)  # 96 inputs: a multiple of 32
    model.layers = [_quantized(128, 16)]
    model.bits3 = _quantized(256, 8, bits=3)  # a width the kernel does not take
    model.float32_scales = nn.QuantizedLinear.from_linear(nn.Linear(128, 8), 64, 4)
    model.dense = nn.Linear(128, 8)
    layers = {name: m for name, m in model.named_modules() if name}
    arrays = {name: dict(m.items()) for name, m in layers.items()}
    inputs = {name: _input(m) for name, m in layers.items()}
    expected = {name: m(inputs[name]) for name, m in layers.items()}

    assert use_few_row_kernel(model) == 4
    layers = {name: m for name, m in model.named_modules() if name}
    swapped = {name for name, m in layers.items() if isinstance(m, FewRowQuantizedLinear)}
    assert swapped == {"q4", "q8", "narrow", "layers.0"}
    for name, layer in layers.items():
        if name in swapped:  # the same arrays, frozen as nn.QuantizedLinear is
            assert set(layer) == set(arrays[name])
            assert all(layer[k] is v for k, v in arrays[name].items())
            assert layer.trainable_parameters() == {}
            # What MLX's layer computes of them, exactly.
            mlx = nn.QuantizedLinear.__call__(layer, inputs[name])
            assert mx.array_equal(mlx, expected[name]), name
        else:
            assert type(layer) in (nn.QuantizedLinear, nn.Linear)
        if name not in swapped or not few_row_matmul.available():  # where no kernel runs
            assert mx.array_equal(layer(inputs[name]), expected[name]), name
    # And back: MLX's layers over the same arrays.
    assert use_mlx_kernels(model) == 4
    for name, layer in model.named_modules():
        if name in swapped:
            assert type(layer) is nn.QuantizedLinear
            assert all(layer[k] is v for k, v in arrays[name].items())
            assert mx.array_equal(layer(inputs[name]), expected[name]), name


def test_kernel_variants_are_built_once_per_quantization() -> None:
    """Each kernel variant (row counts, tiles) runs once per quantization at load, so that no
    user's step compiles one; where the kernels do not run, nothing runs."""
    model = nn.Module()
    model.a = _quantized(256, 70)
    model.b = _quantized(512, 16)  # the same quantization: its variants are a's
    model.q8 = _quantized(128, 33, bits=8, group_size=128)
    use_few_row_kernel(model)
    expected = 2 if few_row_matmul.available() else 0
    assert few_row_matmul.build_kernel_variants(model) == expected
    assert few_row_matmul.VARIANT_ROWS[-1] == tensor_core_matmul.MAX_ROWS


def test_a_loaded_quantized_shard_is_swapped_only_on_cuda(model_dir, tmp_path) -> None:
    q4 = convert(model_dir, tmp_path / "q4", q_bits=4)
    shard = load_shard(q4, for_decoding=True)
    swapped = [m for _, m in shard.named_modules() if isinstance(m, FewRowQuantizedLinear)]
    if few_row_matmul.available():  # every projection, fused ones too, and the lm_head
        assert swapped and shard.lm_head.__class__ is FewRowQuantizedLinear
        assert not any(type(m) is nn.QuantizedLinear for _, m in shard.named_modules())
    else:
        assert swapped == []
    # Left out of the fast path, the kernel is swapped in nowhere.
    without = dataclasses.replace(DecodeFastPath.for_device(), few_row_kernel=False)
    shard = load_shard(q4, for_decoding=True, fast_path=without)
    assert not any(isinstance(m, FewRowQuantizedLinear) for _, m in shard.named_modules())
    assert shard.lm_head.__class__ is nn.QuantizedLinear


def _matmul(kernel: str, layer: nn.Module, x: mx.array) -> mx.array:
    """`layer`'s matmul of the rows `x` [rows, K] on `kernel`."""
    arrays = (layer.weight, layer.scales, layer.biases)
    if kernel == "tensor_core":
        return tensor_core_quantized_matmul(x, *arrays, group_size=layer.group_size)
    return few_row_quantized_matmul(x, *arrays, group_size=layer.group_size, bits=layer.bits)


def _exact(x: mx.array, layer: nn.QuantizedLinear) -> mx.array:
    w = mx.dequantize(
        layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits
    )
    return x.astype(mx.float32) @ w.astype(mx.float32).T


# The rows each kernel takes in the model, and more where it computes them.
ROWS = {"few_row": (1, 2, 3, 5, 8, 13, 16, 32), "tensor_core": (4, 5, 8, 13, 16, 32)}


@pytest.mark.parametrize(
    ("kernel", "rows", "width", "dtype", "says"),
    [("few_row", 33, 128, mx.bfloat16, "1 to 32 rows"),
     ("few_row", 2, 128, mx.float32, "2-byte floats"),
     ("few_row", 2, 96, mx.bfloat16, "do not fit"),
     ("tensor_core", 33, 128, mx.bfloat16, "1 to 32 rows"),
     ("tensor_core", 8, 128, mx.float32, "2-byte floats"),
     ("tensor_core", 8, 64, mx.bfloat16, "do not fit")],
)  # fmt: skip
def test_the_kernels_refuse_what_they_cannot_compute(kernel, rows, width, dtype, says) -> None:
    layer = _quantized(128, 16)
    with pytest.raises(ValueError, match=says):
        _matmul(kernel, layer, mx.zeros((rows, width), dtype))


@pytest.mark.parametrize(("warps", "depth"), [(1, 2), (33, 2), (4, 0), (4, 9)])
def test_the_tensor_core_kernel_refuses_a_launch_it_cannot_compile(warps, depth) -> None:
    layer = _quantized(128, 16)
    arrays = (layer.weight, layer.scales, layer.biases)
    with pytest.raises(ValueError, match="2-32 warps, 1-8 spans deep"):
        tensor_core_quantized_matmul(
            mx.zeros((8, 128), mx.bfloat16), *arrays, group_size=64, warps=warps, depth=depth
        )


@on_cuda
def test_the_tensor_core_kernel_computes_the_same_at_every_depth() -> None:
    """How many spans of weights a warp has in flight changes when its loads are issued, not
    the order of its sums: the output is the same bit for bit."""
    mx.random.seed(2)
    layer = _quantized(1152, 301)
    arrays = (layer.weight, layer.scales, layer.biases)
    for rows in (4, 13, 32):
        x = mx.random.normal((rows, 1152)).astype(mx.bfloat16)
        outputs = [
            tensor_core_quantized_matmul(x, *arrays, group_size=64, depth=depth)
            for depth in (1, 2, 3, 8)
        ]
        assert all(mx.array_equal(y, outputs[0]) for y in outputs[1:]), rows


@on_cuda
@pytest.mark.parametrize(
    ("kernel", "dtype", "bits", "group_size", "steps"),
    [("few_row", mx.bfloat16, 4, 32, 7), ("few_row", mx.bfloat16, 4, 64, 7),
     ("few_row", mx.bfloat16, 4, 128, 7), ("few_row", mx.bfloat16, 8, 64, 7),
     ("tensor_core", mx.bfloat16, 4, 32, 6), ("tensor_core", mx.bfloat16, 4, 64, 6),
     ("tensor_core", mx.bfloat16, 4, 128, 6), ("tensor_core", mx.float16, 4, 64, 6)],
)  # fmt: skip
def test_the_kernels_match_a_float32_reference(kernel, dtype, bits, group_size, steps) -> None:
    """Within 2**-steps of the largest output from the exact sums, and within 2**-6 of MLX's
    own kernel. The few-row kernel rounds its float sums to bf16 once, as MLX does (7); the
    tensor-core one multiplies weights dequantized to 16-bit floats, as MLX's GEMM does, a few
    of their steps (6)."""
    mx.random.seed(0)
    # 1152 inputs: the lanes' last step runs past the end (1024 a step for the few-row kernel);
    # 301 outputs: the last warp's (block's) columns run past the end too.
    layer = _quantized(1152, 301, bits=bits, group_size=group_size, dtype=dtype)
    for rows in ROWS[kernel]:
        x = mx.random.normal((rows, 1152)).astype(dtype)
        ours, mlx = (y.astype(mx.float32) for y in (_matmul(kernel, layer, x), layer(x)))
        exact = _exact(x, layer)
        scale = mx.abs(exact).max().item()
        assert ours.shape == mlx.shape == (rows, 301)
        assert mx.abs(ours - exact).max().item() <= 2**-steps * scale, rows
        assert mx.abs(ours - mlx).max().item() <= 2**-6 * scale, rows


@on_cuda
@pytest.mark.parametrize("kernel", ["few_row", "tensor_core"])
def test_each_row_is_computed_alone(kernel: str) -> None:
    """Batch invariance: a row's output does not depend on the rows beside it, bit for bit."""
    mx.random.seed(1)
    layer = _quantized(2048, 512)
    most = ROWS[kernel][-1]
    x = mx.random.normal((most, 2048)).astype(mx.bfloat16)
    everything = _matmul(kernel, layer, x)
    if kernel != "tensor_core":
        alone = mx.concatenate([_matmul(kernel, layer, x[i : i + 1]) for i in range(most)])
        assert mx.array_equal(everything, alone)
    for rows in ROWS[kernel]:
        assert mx.array_equal(_matmul(kernel, layer, x[:rows]), everything[:rows]), rows


@on_cuda
def test_layers_take_the_kernels_by_rows() -> None:
    layer = _quantized(1024, 64)
    fast = FewRowQuantizedLinear.like(layer)
    arrays = (layer.weight, layer.scales, layer.biases)
    for rows in range(1, 35):
        x = mx.random.normal((1, rows, 1024)).astype(mx.bfloat16)
        if rows <= few_row_matmul.MAX_ROWS:
            expected = few_row_quantized_matmul(x[0], *arrays, group_size=64, bits=4)[None]
        elif rows <= tensor_core_matmul.MAX_ROWS:
            expected = tensor_core_quantized_matmul(x[0], *arrays, group_size=64)[None]
        else:
            expected = layer(x)
        assert mx.array_equal(fast(x), expected), rows


@on_cuda
def test_greedy_decoding_identical_with_the_kernel(model_dir, tokenizer, tmp_path) -> None:
    q4 = convert(model_dir, tmp_path / "q4", q_bits=4)
    assert_greedy_identical_with(
        "few_row_kernel", q4, [tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
    )


@on_cuda
def test_moe_greedy_decoding_identical_with_the_kernel(tmp_path) -> None:
    """The MoE fixture's attention, GatedDeltaNet and shared-expert projections take the
    kernel; its experts (`QuantizedSwitchLinear`) keep MLX's gather kernel."""
    from checkpoints import make_checkpoint

    moe = make_checkpoint(tmp_path / "moe", moe=True, mtp_experts="fused")
    q4 = convert(moe, tmp_path / "q4", q_bits=4)
    shard = load_shard(q4, for_decoding=True)
    assert any(isinstance(m, FewRowQuantizedLinear) for _, m in shard.named_modules())
    assert_greedy_identical_with(
        "few_row_kernel",
        q4,
        [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8]],
        trained_mtp=False,
    )
