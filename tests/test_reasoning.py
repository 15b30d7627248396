"""coordinator.reasoning: `<think>...</think>` served as `reasoning_content`, streaming and not,
whatever the pieces the text arrives in (a marker split across chunks included)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from coordinator.reasoning import ReasoningSplitter, ReplyPiece
from tests.fakes import EOS, MODEL_ID, FakeEngine, Served, serve, tokenizer

HELLO = [{"role": "user", "content": "Show me the source of add"}]
REASONING = "\nThe user wants add. <b>bold</b> is not a marker.\n"
ANSWER = "def add(a, b):\n    return a + b  # </think> here is just text\n"


def _split(pieces: list[str], *, starts_in_reasoning: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_in_reasoning=starts_in_reasoning)
    out = [splitter.feed(piece) for piece in pieces] + [splitter.flush()]
    return "".join(p.reasoning for p in out), "".join(p.content for p in out)


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_every_split_point_gives_the_same_parts(starts_in_reasoning: bool) -> None:
    opening = "" if starts_in_reasoning else "<think>"
    text = f"{opening}{REASONING}</think>\n\n{ANSWER}"
    expected = (REASONING, ANSWER)
    assert _split([text], starts_in_reasoning=starts_in_reasoning) == expected
    assert _split(list(text), starts_in_reasoning=starts_in_reasoning) == expected
    for cut in range(len(text) + 1):
        pieces = [text[:cut], text[cut:]]
        assert _split(pieces, starts_in_reasoning=starts_in_reasoning) == expected, cut


def test_text_held_back_only_while_it_may_be_a_marker() -> None:
    splitter = ReasoningSplitter(starts_in_reasoning=True)
    assert splitter.feed("thinking </thi") == ReplyPiece(reasoning="thinking ")
    assert splitter.feed("nk>\n\nAnswer") == ReplyPiece(content="Answer")
    splitter = ReasoningSplitter(starts_in_reasoning=False)
    assert splitter.feed("  <th") == ReplyPiece()  # may still open a think block
    assert splitter.feed("e end") == ReplyPiece(content="  <the end")


@pytest.mark.parametrize(
    ("text", "starts_in_reasoning", "expected"),
    [
        ("no reasoning at all", False, ("", "no reasoning at all")),
        ("", False, ("", "")),
        ("<thinking> is not <think>", False, ("", "<thinking> is not <think>")),
        ("answer <think>late</think> stays", False, ("", "answer <think>late</think> stays")),
        ("<think>cut off by max_tokens", False, ("cut off by max_tokens", "")),
        ("cut off </thi", True, ("cut off </thi", "")),
        ("  \n<think>x</think>y", False, ("x", "y")),
        ("</think>", True, ("", "")),
    ],
)
def test_edge_cases(text: str, starts_in_reasoning: bool, expected: tuple[str, str]) -> None:
    assert _split([text], starts_in_reasoning=starts_in_reasoning) == expected
    assert _split(list(text), starts_in_reasoning=starts_in_reasoning) == expected


# --- over HTTP, through the official client ------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    ids = (*tokenizer().encode(f"<think>{REASONING}</think>\n\n{ANSWER}"), EOS)
    with serve(FakeEngine(reply=lambda _request: ids, chunk_size=3)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_whole_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL_ID, messages=HELLO)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_reply(client: openai.OpenAI) -> None:
    """Chunks of 3 tokens: `</think>` (4 tokens here) is split across two chunks."""
    reasoning, content, finish = [], [], []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=HELLO, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
        finish.append(chunk.choices[0].finish_reason)
        assert "think>" not in reasoning[-1] + content[-1]
    assert ("".join(reasoning), "".join(content)) == (REASONING, ANSWER)
    assert finish[-1] == "stop"
    assert sum(1 for r in reasoning if r) > 1  # it streamed, not at the end in one piece


def test_enable_thinking_reaches_the_template(client: openai.OpenAI, served: Served) -> None:
    """With thinking on, the template opens the block in the prompt; the reply goes on in it."""
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    reply = client.chat.completions.create(model=MODEL_ID, messages=HELLO, extra_body=thinking)
    prompt = tokenizer().decode(list(served.engine.requests[-1].prompt))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert reply.choices[0].message.content == ANSWER
    client.chat.completions.create(model=MODEL_ID, messages=HELLO)
    prompt = tokenizer().decode(list(served.engine.requests[-1].prompt))
    assert prompt.endswith("<|im_start|>assistant\n")  # the trained format, by default
