"""A shard of a Qwen3.5 model: decoder layers [start, end) plus its role's extras.

The head also holds the token embedding; the tail holds the final norm, the lm_head, the
MTP head and (for an untied model) the embedding that the MTP head needs. A model run in
one process is a single shard that is both head and tail.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from cluster.config import ModelConfig
from cluster.model import few_row_matmul
from cluster.model.even_steps import EvenSteps
from cluster.model.fast_path import DecodeFastPath
from cluster.model.layers import LayerTraces, PackedDecoderLayer, Segment
from cluster.model.mtp import MTPHead
from cluster.model.row_padding import pad_rows, padded_rows

ASYNC_EVAL_EVERY = 8  # layers
# The last chunk's layers are started 4, 2 and 1 layers before the end, so that what the
# device has left once the graph is built is about one layer, not eight: a node's step ends
# with its output read back, and the next node waits for it. The first chunk could be started
# the same way (after 1, 2 and 4 layers), so that a node's device idles less at the start of
# its step; measured, it cost a little on either half of a split step against the last
# chunk's taper alone (the device catches up with the host within the chunk anyway). Off.
TAPER_FIRST_CHUNK = False
TAPER_LAST_CHUNK = True


@functools.cache
def async_eval_slots(n_layers: int, every: int, first: bool, last: bool) -> frozenset[int]:
    """The layer slots after which `ModelShard` starts the device on what is built: every
    `every` layers, the first chunk (`first`) and the last (`last`) tapered."""
    if every > n_layers:
        return frozenset()
    slots = {slot for slot in range(n_layers) if slot % every == every - 1}
    if first:
        slots |= {built - 1 for built in (1, 2, 4) if built < min(every, n_layers)}
    if last:
        slots |= {n_layers - 1 - left for left in (4, 2, 1) if n_layers - 1 - left >= 0}
    return frozenset(slots)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    start: int
    end: int
    is_head: bool
    is_tail: bool

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"invalid layer range [{self.start}, {self.end})")

    @classmethod
    def whole(cls, num_layers: int) -> ShardSpec:
        return cls(0, num_layers, is_head=True, is_tail=True)

    def describe(self) -> str:
        role = "+".join(r for r, on in (("head", self.is_head), ("tail", self.is_tail)) if on)
        return f"layers [{self.start}, {self.end}){' ' + role if role else ''}"


class ModelShard(nn.Module):
    """The layers of `spec` and its role's extras, stepping with the parts of the decode fast
    path that `fast_path` asks for (None: `DecodeFastPath.for_device()`), fixed for the
    shard's life."""

    def __init__(
        self,
        config: ModelConfig,
        spec: ShardSpec,
        *,
        with_mtp: bool,
        fast_path: DecodeFastPath | None = None,
    ):
        super().__init__()
        args = config.text
        if spec.end > args.num_hidden_layers:
            raise ValueError(
                f"layer range [{spec.start}, {spec.end}) exceeds the model's "
                f"{args.num_hidden_layers} layers"
            )
        self.spec = spec
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.tied = args.tie_word_embeddings
        # The tail needs the embedding for the MTP head (and as lm_head when tied).
        if spec.is_head or (spec.is_tail and (with_mtp or self.tied)):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [PackedDecoderLayer(args, i) for i in range(spec.start, spec.end)]
        if spec.is_tail:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if not self.tied:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
            if with_mtp:
                self.mtp = MTPHead(args, config.mtp_layers)
        self.has_mtp = spec.is_tail and with_mtp
        self.is_moe = config.is_moe
        self._configure(DecodeFastPath.for_device() if fast_path is None else fast_path)

    def _configure(self, fast_path: DecodeFastPath) -> None:
        # Plain attributes, not module members.
        self.__dict__["fast_path"] = fast_path
        # Padded rows would be routed to experts (`cluster.model.row_padding`).
        self.__dict__["_pad_rows_from"] = None if self.is_moe else fast_path.pad_rows_from
        traces = LayerTraces()
        for layer in [*self.layers, *(self.mtp.layers if self.has_mtp else ())]:
            layer.use_fast_path(fast_path, traces)

    def use_fast_path(self, fast_path: DecodeFastPath) -> None:
        """Step with `fast_path` from the next step on, between steps only: for a benchmark's
        rounds that compare the fast path's parts on one loaded shard. The compiled traces
        start afresh, and where the few-row kernel runs, the quantized layers are swapped to
        or from it over the same arrays (`cluster.model.few_row_matmul`)."""
        kernel_was = self.fast_path.few_row_kernel
        self._configure(fast_path)
        if fast_path.few_row_kernel != kernel_was and few_row_matmul.available():
            if fast_path.few_row_kernel:
                few_row_matmul.use_few_row_kernel(self)
                few_row_matmul.build_kernel_variants(self)
            else:
                few_row_matmul.use_mlx_kernels(self)

    @property
    def pads_rows(self) -> bool:
        """Whether this shard's short steps run their dense layers on padded rows."""
        return self._pad_rows_from is not None

    @property
    def linear_flags(self) -> list[bool]:
        return [layer.is_linear for layer in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def __call__(self, x: mx.array, segments: list[Segment], *, launch: bool = True) -> mx.array:
        """The layers over `x` [1, L, hidden]; unless not to `launch` (`x` is not there yet:
        cluster.decode.late_input), the device starts on them as they are built."""
        even = EvenSteps.of(segments) if self.fast_path.even_steps else None
        if even is not None:
            x, segments = even.pad(x), even.segments
        length = x.shape[1]
        if (pad_from := self._pad_rows_from) is not None:
            # A short step's dense layers run on the rows matmuls run cheapest.
            x = pad_rows(x, padded_rows(length, pad_from))
        starts = async_eval_slots(
            len(self.layers), ASYNC_EVAL_EVERY, TAPER_FIRST_CHUNK, TAPER_LAST_CHUNK
        )
        for slot, layer in enumerate(self.layers):
            x = layer(x, segments, slot)
            if launch and slot in starts:
                # Start the device on the layers built so far while Python builds the rest:
                # building a step's graph is milliseconds that the device would otherwise idle.
                mx.async_eval(x)
        x = x if x.shape[1] == length else x[:, :length]
        if even is not None:
            even.drop_padding()
            return even.unpad(x)
        return x

    def logits(self, normed: mx.array) -> mx.array:
        if self.tied:
            return self.embed_tokens.as_linear(normed)
        return self.lm_head(normed)


def shard_specs(ranges: list[tuple[int, int]]) -> list[ShardSpec]:
    """Specs for contiguous ranges covering a model: the first is the head, the last the tail."""
    for (_, end), (start, _) in itertools.pairwise(ranges):
        if end != start:
            raise ValueError(f"layer ranges must be contiguous: {ranges}")
    last = len(ranges) - 1
    return [ShardSpec(s, e, i == 0, i == last) for i, (s, e) in enumerate(ranges)]


def even_ranges(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges of near-equal size (the earlier ones take the remainder)."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} parts")
    base, extra = divmod(num_layers, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def parse_layers(text: str) -> list[tuple[int, int]]:
    """'0:3,3:8' -> [(0, 3), (3, 8)]"""
    try:
        return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ValueError(f"--layers wants START:END,START:END,... got {text!r}") from None
