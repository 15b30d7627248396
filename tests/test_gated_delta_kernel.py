"""GatedDeltaNet's recurrence as one CUDA kernel (`cluster.model.gated_delta_kernel`).

Everywhere: what the kernel takes, and that without it (the CPU, or a `DecodeFastPath` that
leaves it out) the layers run mlx-lm's ops.
Where MLX runs on CUDA (`python -m pytest tests/test_gated_delta_kernel.py` there): the kernel
against mlx-lm's ops, with the states a rejected draft restores; each position computed alike
at every step length, so that a restored snapshot is bit for bit the state a step without the
draft leaves; and greedy decoding with the kernel and without, with MTP (rejected drafts rolled
back) and without, on the bundled model (bf16 and 4 bits) and a MoE fixture, equal up to ties
(tests/greedy_ties.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import CODE_PROMPTS
from greedy_ties import assert_greedy_identical_with

from cluster.model import gated_delta_kernel
from cluster.model.convert import convert
from cluster.model.layers import _recurrence, core_step

on_cuda = pytest.mark.skipif(
    not gated_delta_kernel.available(), reason="the kernel runs on MLX's CUDA backend only"
)


def _inputs(batch: int, length: int, k_heads: int, v_heads: int, dim: int, dtype, seed: int = 0):
    """q, k, v, a, b, A_log, dt_bias and a state, as a GatedDeltaNet layer hands them over
    (q and k normalized as mlx-lm's `normalize_qk` leaves them)."""
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    q = mx.random.normal((batch, length, k_heads, dim), key=ks[0])
    k = mx.random.normal((batch, length, k_heads, dim), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dim**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((batch, length, v_heads, dim), key=ks[2])
    a = mx.random.normal((batch, length, v_heads), key=ks[3])
    b = mx.random.normal((batch, length, v_heads), key=ks[4])
    a_log = mx.random.uniform(-1.0, 1.0, (v_heads,), key=ks[5])
    dt_bias = mx.random.normal((v_heads,), key=ks[6])
    state = 0.1 * mx.random.normal((batch, v_heads, dim, dim), key=ks[7])
    inputs = [t.astype(dtype) for t in (q, k, v, a, b)]
    return (*inputs, a_log.astype(dtype), dt_bias.astype(dtype), state)


def _run(inputs, snapshot_at: tuple[int, ...], *, use_kernel: bool):
    q, k, v, a, b, a_log, dt_bias, state = inputs
    length = q.shape[1]
    first = snapshot_at[0] if snapshot_at else length
    step = core_step((q.shape[2], v.shape[2], q.shape[3], v.shape[3]), length, first, use_kernel)
    assert step.snapshot_at == snapshot_at
    out, state, snapshots = _recurrence(q, k, v, a, b, (a_log, dt_bias), state, step)
    mx.eval(out, state, snapshots)
    assert len(snapshots) == len(snapshot_at)
    return out, state, snapshots


def test_it_takes_what_it_computes(monkeypatch) -> None:
    q, _, v, *_, state = _inputs(1, 3, 2, 4, 64, mx.bfloat16)
    assert gated_delta_kernel.takes(q, v, state, ()) == gated_delta_kernel.available()
    monkeypatch.setattr(gated_delta_kernel, "available", lambda: True)
    assert gated_delta_kernel.takes(q, v, state, (1, 2))
    assert not gated_delta_kernel.takes(q, v, state, (3,))  # past the step's positions
    assert not gated_delta_kernel.takes(q, v, state.astype(mx.bfloat16), ())
    q48, _, v48, *_ = _inputs(1, 1, 2, 4, 48, mx.bfloat16)  # a head dim not a multiple of 32
    assert not gated_delta_kernel.takes(q48, v48, state, ())
    q3, _, v3, *_ = _inputs(1, 1, 3, 4, 64, mx.bfloat16)  # 4 value heads over 3 key heads
    assert not gated_delta_kernel.takes(q3, v3, state, ())
    long = _inputs(1, 40, 2, 4, 64, mx.bfloat16)
    assert gated_delta_kernel.takes(long[0], long[2], state, (31,))
    assert not gated_delta_kernel.takes(long[0], long[2], state, (32,))
    monkeypatch.setattr(gated_delta_kernel, "available", lambda: False)
    assert not gated_delta_kernel.takes(q, v, state, ())


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal mlx-lm's own kernel runs")
def test_without_the_kernel_the_ops_run() -> None:
    """Asked for a kernel where none runs (the CPU, or CUDA where it does not take the
    step), the recurrence is mlx-lm's ops, exactly."""
    if gated_delta_kernel.available():
        # A head dim the kernel does not take (48: not a multiple of 32).
        inputs = _inputs(2, 3, 2, 4, 48, mx.float32)
        assert not gated_delta_kernel.takes(inputs[0], inputs[2], inputs[-1], (1, 2))
    else:
        inputs = _inputs(2, 3, 2, 4, 64, mx.float32)
    asked = _run(inputs, (1, 2), use_kernel=True)
    ops = _run(inputs, (1, 2), use_kernel=False)
    for got, expected in zip(
        [asked[0], asked[1], *asked[2]], [ops[0], ops[1], *ops[2]], strict=True
    ):
        assert mx.array_equal(got, expected)


@on_cuda
@pytest.mark.parametrize(
    ("batch", "length", "k_heads", "v_heads", "dim", "snapshot_at"),
    [
        (1, 1, 2, 4, 64, ()),
        (1, 2, 2, 4, 64, (1,)),
        (1, 5, 2, 4, 64, (1, 2, 3, 4)),
        (3, 2, 2, 4, 64, (1,)),
        (1, 2, 16, 48, 128, (1,)),  # Qwen3.5-27B's GatedDeltaNet
        (2, 40, 16, 32, 128, ()),  # a prefill chunk
    ],
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_matches_the_ops(batch, length, k_heads, v_heads, dim, snapshot_at, dtype):
    inputs = _inputs(batch, length, k_heads, v_heads, dim, dtype)
    kernel = _run(inputs, snapshot_at, use_kernel=True)
    ops = _run(inputs, snapshot_at, use_kernel=False)
    assert kernel[0].dtype == ops[0].dtype and kernel[0].shape == ops[0].shape
    # float32 sums in another order; the output rounded to its dtype once
    out_tol = 1e-2 if dtype == mx.bfloat16 else 1e-4
    scale = mx.abs(ops[0].astype(mx.float32)).max().item()
    assert mx.abs(kernel[0].astype(mx.float32) - ops[0].astype(mx.float32)).max().item() <= (
        out_tol * scale
    )
    for got, expected in zip([kernel[1], *kernel[2]], [ops[1], *ops[2]], strict=True):
        assert got.shape == expected.shape
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()


@on_cuda
def test_a_position_is_computed_alike_at_every_length() -> None:
    """The first positions of a longer step are the shorter step's, bit for bit; the
    snapshot kept before position p is the state a step of p positions leaves."""
    q, k, v, a, b, a_log, dt_bias, state = _inputs(1, 3, 16, 48, 128, mx.bfloat16)
    full = _run((q, k, v, a, b, a_log, dt_bias, state), (1, 2), use_kernel=True)
    for length in (1, 2):
        part = [t[:, :length] for t in (q, k, v, a, b)]
        short = _run((*part, a_log, dt_bias, state), (), use_kernel=True)
        assert mx.array_equal(short[0], full[0][:, :length])
        assert mx.array_equal(short[1], full[2][length - 1])


@on_cuda
def test_greedy_decoding_identical_with_the_kernel(model_dir, tokenizer, tmp_path) -> None:
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
    assert_greedy_identical_with("recurrence_kernel", model_dir, prompts)
    q4 = convert(model_dir, tmp_path / "q4", q_bits=4)
    assert_greedy_identical_with("recurrence_kernel", q4, prompts)


@on_cuda
def test_moe_greedy_decoding_identical_with_the_kernel(tmp_path) -> None:
    from checkpoints import make_checkpoint

    moe = make_checkpoint(tmp_path / "moe", moe=True, mtp_experts="fused")
    assert_greedy_identical_with(
        "recurrence_kernel",
        moe,
        [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8]],
        trained_mtp=False,
    )
