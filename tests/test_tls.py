"""TLS as an option: nodes serve it, the driver and the previous node dial it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from conftest import CODE_PROMPTS, run

from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.remote_pipeline import PipelineSettings, load_pipeline, open_remote_engine
from cluster.transport.auth import TLSConfig
from cluster.transport.node_client import NodeClient, NodeUnavailable
from cluster.transport.step_link import StepLinkError, StepSender
from cluster.weights.service import WeightsService, serve_weights
from tests import nodes

node_factory = nodes.node_factory


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed cluster certificate for 127.0.0.1."""
    return nodes.cluster_certificate(tmp_path_factory.mktemp("tls"))


def test_generation_over_tls_matches_and_plain_clients_are_refused(
    node_factory, certificate: tuple[Path, Path], model_dir, tokenizer
) -> None:
    group = node_factory(2, tls=certificate)
    tls = TLSConfig.from_files(certificate[0])
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[1]))

    async def remote() -> tuple[tuple[int, ...], dict[str, object]]:
        engine = await open_remote_engine(
            model_dir, group.addresses, PipelineSettings(group.token, tls=tls)
        )
        try:
            tokens = (await engine.engine.generate(GenerationRequest(prompt, 24))).tokens
            return tokens, engine.pipeline.transports
        finally:
            await engine.close()

    async def local() -> tuple[int, ...]:
        engine = await open_local_engine(model_dir)
        try:
            return (await engine.engine.generate(GenerationRequest(prompt, 24))).tokens
        finally:
            engine.close()

    tokens, transports = run(remote())
    assert tokens == run(local())
    # Steps and results ran over the nodes' TCP streams, encrypted: the streams that move to
    # another address when a link fails.
    assert transports["steps"] == "tcp" and transports["results"] == ["tcp", "tcp"], transports

    async def plain_step_stream() -> None:
        client = NodeClient(group.addresses[0], group.token, tls)
        try:
            port = (await client.info()).step_port
        finally:
            await client.close()
        await StepSender.open("127.0.0.1", port, group.token, timeout_s=2.0)  # no TLS

    with pytest.raises(StepLinkError):
        run(plain_step_stream())

    async def plain_info() -> None:
        client = NodeClient(group.addresses[0], group.token)  # no TLS
        try:
            await client.info(timeout=2.0)
        finally:
            await client.close()

    with pytest.raises(NodeUnavailable):
        run(plain_info())

    async def wrong_token() -> None:
        client = NodeClient(group.addresses[0], "not-the-token", tls)
        try:
            await client.info(timeout=2.0)
        finally:
            await client.close()

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        run(wrong_token())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_without_its_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match="needs its certificate"):
        TLSConfig.from_files(None, "key.pem")


def test_a_node_without_the_model_fetches_it_over_tls(
    node_factory, certificate: tuple[Path, Path], model_dir, tokenizer, tmp_path
) -> None:
    """The coordinator's Weights service serves TLS with the cluster certificate's key."""
    group = node_factory(1, tls=certificate, args=lambda i: ["--cache-dir", str(tmp_path)])
    tls = TLSConfig.from_files(*certificate)
    service = WeightsService(model_dir, group.token)
    server, port = serve_weights(service, "127.0.0.1", 0, tls)
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))

    async def go() -> tuple[tuple[int, ...], tuple[int, ...]]:
        settings = PipelineSettings(
            group.token,
            tls=TLSConfig.from_files(certificate[0]),
            node_model_dir="/nonexistent/qwen3_5-tiny-mtp",
            model_digest=service.manifest.digest,
            weights_port=port,
        )
        pipeline = await load_pipeline(model_dir, group.addresses, settings)
        local = await open_local_engine(model_dir)
        try:
            # Under TLS the driver's steps and results take the node's encrypted TCP streams.
            assert pipeline.transports == {"steps": "tcp", "results": ["tcp"]}
            remote_out = await GenerationEngine(pipeline).generate(GenerationRequest(prompt, 16))
            local_out = await local.engine.generate(GenerationRequest(prompt, 16))
            return remote_out.tokens, local_out.tokens
        finally:
            local.close()
            await pipeline.close()

    try:
        remote_tokens, local_tokens = run(go())
    finally:
        server.stop(None)
    assert remote_tokens == local_tokens
    assert service.transfers.snapshot()[0].sent_bytes > 0  # it did fetch, over TLS
    assert service.bulk_port == 0  # and only over TLS: no plain bulk stream beside it
