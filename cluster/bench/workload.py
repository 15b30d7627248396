"""What `cluster bench` sends: scenarios, and prompts of an exact length in tokens.

Prompts are real text in the style the bundled model was trained on (CPython 3.11 standard
library sources, shipped compressed in `cluster/assets/bench_corpus.py.gz`), so that MTP
acceptance is what a user would see, not that of random ids. The corpus is tokenized once and
read as a ring: prompt k of a scenario starts at its own offset, so no two prompts share a
prefix (TTFT is uncached) and any length fits. Prompts go to the server as token ids, so their
length is exact; the server's usage says it back and the bench checks it.
"""

from __future__ import annotations

import gzip
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS_PATH = Path(__file__).resolve().parents[1] / "assets" / "bench_corpus.py.gz"
SAMPLED_TEMPERATURE = 0.7  # the model card: greedy decoding loops on a small model
PROMPT_STRIDE = 97  # tokens between the starts of consecutive prompts (a prime: no cycles)
_PIECE = re.compile(r"(?s).{1,4000}(?:\n\n|$)")  # tokenized piecewise: no long-input warning


class WorkloadError(ValueError):
    """A workload that cannot be run as asked (bad list, zero concurrency...)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """One configuration: its requests share prompt length, load, sampling and MTP.

    The load is either closed-loop (`concurrency` requests in flight at all times) or
    open-loop (`rate` requests/s with Poisson arrivals, no cap on those in flight).
    """

    prompt_tokens: int
    max_tokens: int
    requests: int
    sampled: bool
    mtp: bool
    concurrency: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise WorkloadError("a scenario has either a concurrency or a rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.prompt_tokens < 1 or self.max_tokens < 1 or self.requests < 1:
            raise WorkloadError("prompt tokens, max tokens and requests must be >= 1")

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}/s"

    @property
    def name(self) -> str:
        sampling = "sampled" if self.sampled else "greedy"
        mtp = "mtp" if self.mtp else "no-mtp"
        return f"p{self.prompt_tokens} {self.load} {sampling} {mtp}"

    def settings(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "sampling": "sampled" if self.sampled else "greedy",
            "temperature": SAMPLED_TEMPERATURE if self.sampled else 0.0,
            "mtp": self.mtp,
        }


def positive_ints(text: str, option: str) -> list[int]:
    """'64,256' -> [64, 256]; anything else is a `WorkloadError` naming the option."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise WorkloadError(f"{option} wants positive integers like 1,4,8; got {text!r}") from None
    if any(value < 1 for value in values):
        raise WorkloadError(f"{option} values must be >= 1; got {text!r}")
    return list(dict.fromkeys(values))


def positive_floats(text: str, option: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise WorkloadError(f"{option} wants positive numbers like 0.5,2; got {text!r}") from None
    if any(not value > 0 for value in values):
        raise WorkloadError(f"{option} values must be > 0; got {text!r}")
    return list(dict.fromkeys(values))


def scenarios(
    *,
    prompt_tokens: list[int],
    max_tokens: int,
    concurrency: list[int],
    rates: list[float],
    sampling: list[bool],
    mtp: list[bool],
    requests: int | None,
) -> list[Scenario]:
    """Every combination, closed-loop levels first. `requests` None: 2 per stream of a level
    (at least 2) closed-loop, 4 x rate (at least 4) open-loop."""
    out = []
    loads: list[tuple[int | None, float | None]] = [(c, None) for c in concurrency]
    loads += [(None, r) for r in rates]
    for (conc, rate), prompt, sampled, on in itertools.product(loads, prompt_tokens, sampling, mtp):
        count = requests or (max(2, 2 * conc) if conc else max(4, round(4 * (rate or 0))))
        out.append(Scenario(prompt, max_tokens, count, sampled, on, conc, rate))
    return out


class PromptSource:
    """Prompts of exact token lengths cut from the corpus ring, each from its own offset, the
    first at `start` (taken modulo the ring's length: `start` is where this source began)."""

    def __init__(self, tokenizer: Any, start: int = 0) -> None:
        text = gzip.decompress(CORPUS_PATH.read_bytes()).decode()
        self.tokenizer = tokenizer
        self.ids: tuple[int, ...] = tuple(
            token for piece in _PIECE.findall(text) for token in tokenizer.encode(piece)
        )
        self.start = self._next = start % len(self.ids)

    def take(self, length: int) -> tuple[int, ...]:
        """The next prompt of `length` tokens; consecutive prompts start `PROMPT_STRIDE` apart."""
        start, self._next = self._next, (self._next + PROMPT_STRIDE) % len(self.ids)
        ring = itertools.islice(itertools.cycle(self.ids), start, start + length)
        return tuple(ring)

    def text(self, length: int) -> str:
        """The next prompt of `length` tokens as text (for a chat message; the server's chat
        template and tokenizer decide its exact length)."""
        return self.tokenizer.decode(list(self.take(length)))
