"""plan_placement: memory first, then the slowest stage, fewest nodes; and `cluster plan`."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from cluster.commands.plan import plan_command
from cluster.config import bundled_model_path
from cluster.model.footprint import ModelFootprint
from cluster.placement import (
    SAFETY_MARGIN,
    NodeCapacity,
    PlacementError,
    PlacementPlan,
    plan_placement,
)

MB = 1_000_000
GIB = 1 << 30


def model(
    layers: int = 8,
    layer_bytes: int | list[int] = MB,
    *,
    embed: int = 0,
    lm_head: int = 0,
    mtp: int = 0,
    kv: int = 0,
    gdn: int = 0,
    attention: tuple[int, ...] = (),
) -> ModelFootprint:
    sizes = layer_bytes if isinstance(layer_bytes, list) else [layer_bytes] * layers
    return ModelFootprint(
        path=Path("synthetic"),
        model_type="qwen3_5",
        layer_weight_bytes=tuple(sizes),
        layer_is_attention=tuple(i in attention for i in range(len(sizes))),
        embed_bytes=embed,
        lm_head_bytes=lm_head,
        final_norm_bytes=0,
        mtp_bytes=mtp,
        other_bytes=0,
        tie_word_embeddings=False,
        kv_bytes_per_token=kv,
        gdn_state_bytes=gdn,
        mtp_layers=1 if mtp else 0,
    )


def node(node_id: str, memory: float, bandwidth: float = 100.0) -> NodeCapacity:
    """A node whose usable memory (after the margin) is `memory` bytes."""
    return NodeCapacity(
        node_id, f"{node_id}:5000", math.ceil(memory / (1 - SAFETY_MARGIN)), bandwidth
    )


def place(nodes: list[NodeCapacity], m: ModelFootprint, **kw: object) -> PlacementPlan:
    kw.setdefault("context_tokens", 1)
    kw.setdefault("concurrency", 1)
    return plan_placement(nodes, m, **kw)  # type: ignore[arg-type]


def ranges(plan: PlacementPlan) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.shard.start, s.shard.end) for s in plan.stages]


def check_invariants(plan: PlacementPlan, m: ModelFootprint, nodes: list[NodeCapacity]) -> None:
    shards = [s.shard for s in plan.stages]
    assert shards[0].start == 0 and shards[-1].end == m.num_layers
    assert all(a.end == b.start for a, b in itertools.pairwise(shards))
    assert all(s.start < s.end for s in shards)
    assert [s.is_head for s in shards] == [True] + [False] * (len(shards) - 1)
    assert [s.is_tail for s in shards] == [False] * (len(shards) - 1) + [True]
    stages = plan.stages
    by_id = {n.node_id: n for n in nodes}
    for s in stages:
        assert s.required_bytes <= by_id[s.node_id].usable_bytes


# --- fewest nodes, memory first -----------------------------------------------------------


def test_fits_on_one_node() -> None:
    m = model()
    plan = place([node("a", 100 * MB), node("b", 100 * MB)], m)
    assert ranges(plan) == [("a", 0, 8)]
    assert plan.stages[0].shard.is_head and plan.stages[0].shard.is_tail
    assert any("one node is enough" in r for r in plan.reasons)
    assert any("not used: b" in r for r in plan.reasons)


def test_memory_limited_uses_more_nodes_but_no_more_than_needed() -> None:
    m = model()  # 8 MB of layers
    nodes = [node("a", 5 * MB), node("b", 5 * MB), node("c", 5 * MB)]
    plan = place(nodes, m)
    assert len(plan.stages) == 2
    check_invariants(plan, m, nodes)
    assert any("2 nodes: the fewest that fit" in r for r in plan.reasons)


def test_use_all_uses_every_node() -> None:
    m = model()
    nodes = [node("a", 100 * MB), node("b", 100 * MB), node("c", 100 * MB)]
    plan = place(nodes, m, use_all=True)
    assert sorted(s.node_id for s in plan.stages) == ["a", "b", "c"]
    check_invariants(plan, m, nodes)
    assert sorted(s.num_layers for s in plan.stages) == [2, 3, 3]


def test_largest_node_alone_when_it_suffices() -> None:
    m = model()
    plan = place([node("small", 2 * MB), node("big", 9 * MB)], m)
    assert ranges(plan) == [("big", 0, 8)]


def test_caches_count_against_memory() -> None:
    m = model(kv=1000, gdn=50_000, attention=(3, 7))
    # 8 MB of weights; 2 attention layers x 1000 B/token x 2000 tokens x 2 requests = 8 MB
    need = 8 * MB + 2 * 1000 * 2000 * 2 + 6 * 50_000 * 2
    assert len(place([node("a", need)], m, context_tokens=2000, concurrency=2).stages) == 1
    with pytest.raises(PlacementError):
        place([node("a", need - 1)], m, context_tokens=2000, concurrency=2)


def test_safety_margin_is_kept() -> None:
    m = model()
    exact = NodeCapacity("a", "", 8 * MB)  # free memory == the weights: no room for the margin
    with pytest.raises(PlacementError, match="less 10%"):
        place([exact], m)


# --- speed -------------------------------------------------------------------------------


def test_balanced_by_bandwidth() -> None:
    m = model()
    nodes = [node("slow", 100 * MB, 100.0), node("fast", 100 * MB, 300.0)]
    plan = place(nodes, m, use_all=True)
    layers = {s.node_id: s.num_layers for s in plan.stages}
    assert layers == {"slow": 2, "fast": 6}
    times = [s.stage_time_estimate for s in plan.stages]
    assert times[0] == pytest.approx(times[1])
    assert plan.bottleneck_time == pytest.approx(2 * MB / 100e9)


def test_faster_node_preferred_when_one_is_enough() -> None:
    m = model()
    plan = place([node("slow", 100 * MB, 100.0), node("fast", 100 * MB, 400.0)], m)
    assert ranges(plan) == [("fast", 0, 8)]


def test_tail_read_bytes_count_toward_its_time() -> None:
    # lm_head + MTP stream 4 MB per step on the tail: with equal nodes the tail gets fewer layers
    m = model(lm_head=2 * MB, mtp=2 * MB)
    nodes = [node("a", 100 * MB), node("b", 100 * MB)]
    plan = place(nodes, m, use_all=True)
    assert [s.num_layers for s in plan.stages] == [6, 2]
    assert plan.stages[0].stage_time_estimate == pytest.approx(plan.stages[1].stage_time_estimate)


# --- head and tail extras ----------------------------------------------------------------


def test_tail_carries_the_extras() -> None:
    m = model(embed=3 * MB, lm_head=3 * MB, mtp=1 * MB, kv=100, attention=(7,))
    nodes = [node("a", 100 * MB), node("b", 100 * MB)]
    plan = place(nodes, m, use_all=True, context_tokens=1000, concurrency=1)
    head, tail = plan.stages
    assert head.weight_bytes == head.num_layers * MB + 3 * MB  # embed_tokens
    # final norm, lm_head, MTP and the MTP head's own embed_tokens
    assert tail.weight_bytes == tail.num_layers * MB + 3 * MB + 1 * MB + 3 * MB
    # layer 7's KV cache plus the MTP head's
    assert tail.cache_bytes == 100 * 1000 * 2
    assert any("tail" in r and "MTP" in r for r in plan.reasons)


def test_extras_go_to_the_node_that_can_carry_them() -> None:
    # only "big" can hold the tail's 6 MB of extras; "small" becomes the head
    m = model(embed=1 * MB, lm_head=3 * MB, mtp=2 * MB)
    nodes = [node("small", 6 * MB), node("big", 12 * MB)]
    plan = place(nodes, m)
    assert [s.node_id for s in plan.stages] == ["small", "big"]
    check_invariants(plan, m, nodes)


def test_single_node_holds_embed_tokens_once() -> None:
    m = model(embed=3 * MB, lm_head=3 * MB, mtp=1 * MB)
    plan = place([node("a", 8 * MB + 7 * MB)], m)
    assert plan.stages[0].weight_bytes == 8 * MB + 7 * MB


# --- fixed split -------------------------------------------------------------------------


def test_layers_override() -> None:
    m = model()
    nodes = [node("a", 100 * MB), node("b", 100 * MB)]
    plan = place(nodes, m, layers=[(0, 3), (3, 8)])
    assert ranges(plan) == [("a", 0, 3), ("b", 3, 8)]
    assert any("--layers" in r for r in plan.reasons)


@pytest.mark.parametrize(
    "layers, message",
    [
        ([(0, 8)], "one per node"),
        ([(0, 3), (4, 8)], "contiguous"),
        ([(0, 4), (3, 8)], "contiguous"),
        ([(1, 4), (4, 8)], "contiguous"),
        ([(0, 3), (3, 7)], "end at 7"),
        ([(0, 8), (8, 8)], "non-empty"),
        ([(0, 3), (3, 9)], "end at 9"),
    ],
)
def test_layers_override_validated(layers: list[tuple[int, int]], message: str) -> None:
    nodes = [node("a", 100 * MB), node("b", 100 * MB)]
    with pytest.raises(PlacementError, match=message):
        place(nodes, model(), layers=layers)


def test_layers_override_that_does_not_fit_names_the_node() -> None:
    nodes = [node("a", 100 * MB), node("b", 2 * MB)]
    with pytest.raises(PlacementError, match=r"node b: layers \[3, 8\) need"):
        place(nodes, model(), layers=[(0, 3), (3, 8)])


# --- refusals ----------------------------------------------------------------------------


def test_refusal_says_needed_and_available() -> None:
    nodes = [node("a", 3 * MB), node("b", 3 * MB)]
    with pytest.raises(PlacementError) as err:
        place(nodes, model())
    text = str(err.value)
    assert "does not fit" in text
    assert str(8 * MB) in text  # bytes needed
    assert str(sum(n.usable_bytes for n in nodes)) in text  # bytes available


def test_refusal_when_the_sum_fits_but_no_split_does() -> None:
    m = model(layer_bytes=[MB, MB, 5 * MB, MB])  # one layer larger than any node
    with pytest.raises(PlacementError, match="no contiguous split fits"):
        place([node("a", 4 * MB), node("b", 4 * MB), node("c", 4 * MB)], m)


def test_bad_inputs() -> None:
    with pytest.raises(PlacementError, match="no nodes"):
        place([], model())
    with pytest.raises(PlacementError, match="duplicate"):
        place([node("a", MB), node("a", MB)], model())
    with pytest.raises(PlacementError, match="concurrency"):
        place([node("a", 100 * MB)], model(), concurrency=0)
    with pytest.raises(PlacementError, match="bandwidth"):
        NodeCapacity("a", "", MB, 0.0)


# --- optimality against brute force ------------------------------------------------------


def compositions(total: int, parts: int) -> list[list[int]]:
    return [
        [b - a for a, b in itertools.pairwise((0, *cuts, total))]
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def brute_force(
    nodes: list[NodeCapacity], m: ModelFootprint, k: int, orders: list | None = None
) -> float:
    """The best bottleneck over every ordering of every k nodes and every split."""
    best = math.inf
    for order in orders or itertools.permutations(nodes, k):
        for sizes in compositions(m.num_layers, k):
            ends = list(itertools.accumulate(sizes))
            layers = list(zip([0, *ends[:-1]], ends, strict=True))
            try:
                plan = place(list(order), m, layers=layers)
            except PlacementError:
                continue
            best = min(best, plan.bottleneck_time)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_uniform_layers(seed: int) -> None:
    rng = random.Random(seed)
    n_layers = rng.randint(2, 7)
    m = model(
        n_layers,
        embed=rng.randint(0, 3) * MB,
        lm_head=rng.randint(0, 3) * MB,
        mtp=rng.choice([0, MB]),
    )
    nodes = [
        node(f"n{i}", rng.randint(2, 9) * MB, rng.choice([50.0, 100.0, 200.0, 400.0]))
        for i in range(rng.randint(1, 4))
    ]
    use_all = rng.random() < 0.3
    sizes = [len(nodes)] if use_all else range(1, len(nodes) + 1)
    expected = next(((k, t) for k in sizes if (t := brute_force(nodes, m, k)) < math.inf), None)
    if expected is None:
        with pytest.raises(PlacementError):
            place(nodes, m, use_all=use_all)
        return
    plan = place(nodes, m, use_all=use_all)
    check_invariants(plan, m, nodes)
    assert len(plan.stages) == expected[0]
    assert plan.bottleneck_time == pytest.approx(expected[1], rel=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_split_is_optimal_for_its_order_on_mixed_layers(seed: int) -> None:
    rng = random.Random(100 + seed)
    sizes = [rng.randint(1, 4) * MB for _ in range(rng.randint(3, 8))]
    m = model(layer_bytes=sizes, lm_head=MB, kv=10, attention=(1,))
    nodes = [node(f"n{i}", 40 * MB, rng.choice([50.0, 100.0, 300.0])) for i in range(3)]
    plan = place(nodes, m, use_all=True, context_tokens=100)
    by_id = {n.node_id: n for n in nodes}
    order = [[by_id[s.node_id] for s in plan.stages]]
    assert plan.bottleneck_time == pytest.approx(brute_force(nodes, m, 3, order), rel=1e-9)


def test_bundled_model_on_two_small_nodes() -> None:
    m = ModelFootprint.from_dir(bundled_model_path())
    nodes = [node("a", 20 * MB), node("b", 20 * MB)]
    plan = place(nodes, m, context_tokens=1024, concurrency=2)
    assert len(plan.stages) == 2
    check_invariants(plan, m, nodes)
    table = plan.format_table()
    assert "a:5000" in table and "b:5000" in table and "head" in table and "tail" in table


# --- `cluster plan` ----------------------------------------------------------------------


def test_cli_plan_prints_table_and_reasons() -> None:
    args = ["--node", "a=1", "--node", "b=1@200", "--context", "512"]
    result = CliRunner().invoke(plan_command, args)
    assert result.exit_code == 0, result.output
    assert "[0, 8)" in result.output
    assert "one node is enough: b" in result.output


def test_cli_plan_layers_and_all_nodes() -> None:
    args = ["--node", "a=1", "--node", "b=1", "--layers", "0:3,3:8", "--context", "512"]
    result = CliRunner().invoke(plan_command, args)
    assert result.exit_code == 0, result.output
    assert "[0, 3)" in result.output and "[3, 8)" in result.output
    result = CliRunner().invoke(plan_command, ["--node", "a=1", "--node", "b=1", "--all-nodes"])
    assert result.exit_code == 0, result.output
    assert "all 2 nodes used" in result.output


def test_cli_plan_refusal_exits_1() -> None:
    result = CliRunner().invoke(plan_command, ["--node", "a=0.001", "--context", "512"])
    assert result.exit_code == 1
    assert "does not fit" in result.output


def test_cli_plan_rejects_bad_specs() -> None:
    assert CliRunner().invoke(plan_command, ["--node", "a"]).exit_code == 2
    assert CliRunner().invoke(plan_command, ["--node", "a=1", "--layers", "0-8"]).exit_code == 2
    assert CliRunner().invoke(plan_command, []).exit_code == 2
