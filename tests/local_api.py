"""The coordinator's HTTP app in front of the real in-process engine (the bundled model),
recording what each request emitted, for tests that check the model's own numbers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from cluster.config import bundled_model_path
from cluster.decode.engine import GenerationChunk, GenerationRequest
from cluster.decode.local_engine import LocalEngine, open_local_engine
from coordinator.admission import AdmissionController
from coordinator.api import ServedModel, create_app
from tests.fakes import MODEL_ID, FakeClusterView, ServedApp, tokenizer


class RecordingEngine:
    """The local engine, opened on the server's loop, recording the last request and tokens."""

    def __init__(self) -> None:
        self.local: LocalEngine | None = None
        self.request: GenerationRequest | None = None
        self.emitted: list[int] = []
        self.drafted = 0

    @property
    def max_context(self) -> int:
        assert self.local is not None
        return self.local.engine.max_context

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        assert self.local is not None
        self.request, self.emitted = request, []
        async for chunk in self.local.engine.stream(request):
            self.emitted += chunk.tokens
            self.drafted = chunk.drafted
            yield chunk


@contextmanager
def serve_local_engine(*, mtp: bool) -> Iterator[tuple[ServedApp, RecordingEngine]]:
    engine = RecordingEngine()
    admission = AdmissionController(2, 2, 10.0)
    app = create_app(
        engine, tokenizer(), FakeClusterView(), served=ServedModel(MODEL_ID), admission=admission
    )
    served = ServedApp(app)
    served.start()
    try:
        engine.local = served.call(open_local_engine(bundled_model_path(), mtp=mtp))
        yield served, engine
    finally:
        served.stop()  # first: a handler may still be releasing its request on the engine
        if engine.local is not None:
            engine.local.close()
