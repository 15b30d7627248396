"""The coordinator's Weights service: started with the coordinator, named in every LoadShard,
its transfers drawn as progress bars."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from cluster.transport.auth import TLSConfig
from cluster.weights.service import WeightsService, serve_weights
from coordinator.progress import ProgressBars

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5


class WeightsHost:
    def __init__(self, model_dir: Path, token: str, tls: TLSConfig | None, *, port: int = 0):
        self.model_dir = model_dir
        self.token = token
        self.tls = tls
        self.port = port
        self.service: WeightsService | None = None
        self._server = None

    async def start(self) -> None:
        """Hash the model (once; cached beside it) and listen on every interface."""
        if self.tls is not None and self.tls.key is None:
            log.warning(
                "TLS without the certificate's key (--tls-key): no weights service; every "
                "node needs the model at its own path"
            )
            return
        self.service = await asyncio.to_thread(WeightsService, self.model_dir, self.token)
        self._server, self.port = serve_weights(self.service, "0.0.0.0", self.port, self.tls)
        log.info(
            "serving weights of %s (%s) on port %d",
            self.model_dir,
            self.service.manifest.digest,
            self.port,
        )

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)
            self._server = None

    def load_args(self) -> dict[str, object]:
        """What load_pipeline needs to let nodes fetch from here."""
        if self.service is None:
            return {}
        return {"model_digest": self.service.manifest.digest, "weights_port": self.port}

    async def show_progress(self, bars: ProgressBars | None = None) -> None:
        bars = bars or ProgressBars()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            if self.service is not None:
                bars.draw(self.service.transfers.snapshot(), time.monotonic())
