"""Weights to nodes: a node with an empty cache and no model directory fetches exactly its shard
from the coordinator's Weights service, verified, and serves the single-process engine's tokens;
an interrupted transfer resumes; corrupted chunks (on the wire, on disk) are fetched again and
never loaded; a model is named by its content; bad peers and full disks get clear errors.

The Weights service runs in this process (as in the coordinator) over a copy of the bundled
model; the nodes are real `cluster node` processes, each with its own cache directory.
"""

from __future__ import annotations

import asyncio
import http.server
import io
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import nodes
import pytest
from click.testing import CliRunner
from conftest import CODE_PROMPTS, greedy_tokens, run
from nodes import NodeGroup, node_infos

from cluster.commands.models import models_command
from cluster.commands.status import status_command
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.remote_pipeline import PipelineSettings, load_pipeline
from cluster.messages import RequestOptions
from cluster.model.loading import shard_tensor_names
from cluster.model.shard import ShardSpec, even_ranges, shard_specs
from cluster.transport.auth import token_metadata
from cluster.transport.node_client import NodeClient, NodeUnavailable
from cluster.weights import bulk
from cluster.weights.fetch import CRASH_AFTER_ENV, ShardFetcher
from cluster.weights.manifest import build_manifest, manifest_for, read_safetensors_header
from cluster.weights.service import (
    FETCH_METHOD,
    WeightsService,
    decode_chunk,
    encode_chunk,
    serve_weights,
)
from cluster.weights.source import Transfers
from cluster.weights.store import WeightsStore
from coordinator.discovery import NodeDirectory
from coordinator.progress import ProgressBars, transfer_fraction
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from proto import cluster_pb2 as pb

node_factory = nodes.node_factory

MAX_TOKENS = 24
NUM_LAYERS = 8
MISSING_DIR = "/nonexistent/elsewhere/qwen3_5-tiny-mtp"  # a path no node has


@dataclass
class Source:
    service: WeightsService
    port: int
    model_dir: Path

    @property
    def digest(self) -> str:
        return self.service.manifest.digest


def _serve(model_dir: Path) -> Iterator[Source]:
    service = WeightsService(model_dir, nodes.TOKEN)
    server, port = serve_weights(service, "127.0.0.1", 0)
    try:
        yield Source(service, port, model_dir)
    finally:
        server.stop(grace=None)


def _copy_model(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns(".cluster-manifest*"))
    return dest


@pytest.fixture(scope="module")
def source(model_dir, tmp_path_factory) -> Iterator[Source]:
    copy = _copy_model(model_dir, tmp_path_factory.mktemp("coordinator") / model_dir.name)
    yield from _serve(copy)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("caches")
    return [root / f"node-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def group(node_factory, caches) -> NodeGroup:
    """Nodes 0, 1: a pair; 2: dies half way through its first transfer; 3: a 1 MiB cache cap."""
    half = str(6 * 2**20)
    return node_factory(
        4,
        args=lambda i: ["--cache-dir", str(caches[i]), *(["--cache-cap-gb", "0.001"] * (i == 3))],
        env=lambda i: {CRASH_AFTER_ENV: half} if i == 2 else {},
    )


@pytest.fixture(scope="module")
def requests(tokenizer) -> list[GenerationRequest]:
    return [
        GenerationRequest(tuple(tokenizer.encode(p)), MAX_TOKENS, RequestOptions(mtp=True))
        for p in CODE_PROMPTS[:2]
    ]


@pytest.fixture(scope="module")
def reference(greedy_reference) -> list[tuple[int, ...]]:
    """The requests' tokens in one process."""
    return greedy_tokens(greedy_reference[True][:2], MAX_TOKENS)


def shard_bytes(model_dir: Path, spec: ShardSpec) -> int:
    """The byte size of the shard's tensors, from the safetensors headers."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {f: read_safetensors_header(model_dir / f)[1] for f in set(index.values())}
    total = 0
    for name in shard_tensor_names(model_dir, spec):
        begin, end = headers[index[name]][name]["data_offsets"]
        total += end - begin
    return total


async def _generate(source: Source, addresses, requests, *, ranges=None, node_dir=MISSING_DIR):
    settings = PipelineSettings(
        nodes.TOKEN,
        ranges=ranges,
        node_model_dir=node_dir,
        model_digest=source.digest,
        weights_port=source.port,
    )
    pipeline = await load_pipeline(source.model_dir, addresses, settings)
    try:
        engine = GenerationEngine(pipeline)
        return [(await engine.generate(r)).tokens for r in requests]
    finally:
        await pipeline.close()


async def _load(address: str, source: Source, spec: ShardSpec, node_dir: str = MISSING_DIR):
    client = NodeClient(address, nodes.TOKEN)
    try:
        return await client.load_shard(
            pb.LoadShardRequest(
                model_dir=node_dir,
                start=spec.start,
                end=spec.end,
                is_head=spec.is_head,
                is_tail=spec.is_tail,
                model_digest=source.digest,
                weights_port=source.port,
            )
        )
    finally:
        await client.close()


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


WHOLE = ShardSpec(0, NUM_LAYERS, True, True)


# ---- the transfer ----


def test_empty_cache_node_fetches_exactly_its_shard(group, source, requests, reference):
    pair = group.addresses[:2]
    assert run(_generate(source, pair, requests)) == reference
    specs = shard_specs(even_ranges(NUM_LAYERS, 2))
    for info, spec in zip(run(node_infos(pair)), specs, strict=True):
        expected = shard_bytes(source.model_dir, spec)
        assert info.weights_fetch_total_bytes == expected
        assert info.weights_fetched_bytes == expected
        # Every byte received: the tensors, the config and index files, message headers.
        assert expected <= info.weights_received_bytes <= expected * 1.01
        assert info.weights_bytes <= expected * 1.1  # the node holds its shard, no more
    # Loaded again: the cache has it all, verified on read; nothing is fetched.
    assert run(_generate(source, pair, requests)) == reference
    assert [i.weights_fetch_total_bytes for i in run(node_infos(pair))] == [0, 0]
    # `cluster models --nodes` lists what each node's cache holds.
    out = CliRunner().invoke(models_command, ["--nodes", ",".join(pair), "--token", nodes.TOKEN])
    assert out.exit_code == 0, out.output
    assert out.output.count(source.digest) == 2 and out.output.count("node ") == 2


def test_a_byte_flipped_in_the_cache_is_fetched_again(group, caches, source, requests, reference):
    manifest = source.service.manifest
    embed = manifest.tensors["model.language_model.embed_tokens.weight"]  # node 0's (the head)
    _flip_byte(caches[0] / source.digest / embed.file, embed.start + 12345)
    assert run(_generate(source, group.addresses[:2], requests)) == reference
    info = run(node_infos(group.addresses[:1]))[0]
    assert info.weights_fetch_total_bytes == embed.chunk_range(0, manifest.chunk_bytes)[1]


def test_a_chunk_corrupted_on_the_wire_is_fetched_again(group, caches, source, requests, reference):
    shutil.rmtree(caches[1] / source.digest)
    seen: list[tuple[str, int]] = []

    def flip_first(ref, data: bytes) -> bytes:
        seen.append(ref)
        return bytes([data[0] ^ 1]) + data[1:] if seen.count(ref) == 1 and len(seen) == 1 else data

    source.service.tamper = flip_first
    try:
        assert run(_generate(source, group.addresses[:2], requests)) == reference
    finally:
        source.service.tamper = None
    assert seen.count(seen[0]) == 2  # sent, refused by the node, sent again
    assert len(seen) == len(set(seen)) + 1


def test_a_chunk_that_never_verifies_is_never_loaded(group, caches, source):
    shutil.rmtree(caches[1] / source.digest, ignore_errors=True)
    source.service.tamper = lambda ref, data: bytes([data[0] ^ 1]) + data[1:]
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            run(_load(group[1].address, source, ShardSpec(4, 8, False, True)))
    finally:
        source.service.tamper = None
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "failing verification" in error.value.details()
    assert not run(node_infos([group[1].address]))[0].HasField("shard")


def test_an_interrupted_transfer_fetches_only_the_rest(
    group, node_factory, caches, source, requests, reference
):
    crashing = group[2]
    with pytest.raises(NodeUnavailable):  # the node dies mid-transfer (the test hook)
        run(_load(crashing.address, source, WHOLE))
    crashing.process.wait(timeout=10)
    restarted = node_factory(1, args=lambda i: ["--cache-dir", str(caches[2])])
    whole = shard_bytes(source.model_dir, WHOLE)
    info = run(_load(restarted[0].address, source, WHOLE))
    assert 0 < info.weights_fetch_total_bytes <= whole - 6 * 2**20
    assert run(_generate(source, restarted.addresses, requests, ranges=[(0, 8)])) == reference


# ---- what a model is ----


def test_a_model_is_named_by_content_not_path(model_dir, source, tmp_path):
    other_place = _copy_model(model_dir, tmp_path / "a" / "somewhere-else")
    assert manifest_for(other_place).digest == source.digest == manifest_for(model_dir).digest
    impostor = _copy_model(model_dir, tmp_path / "b" / model_dir.name)  # same name, other bytes
    lm_head = source.service.manifest.tensors["lm_head.weight"]
    _flip_byte(impostor / lm_head.file, lm_head.start)
    assert build_manifest(impostor).digest != source.digest


def test_a_node_reads_a_local_copy_of_the_same_model_and_fetches_nothing(
    group, caches, source, model_dir, tmp_path, requests, reference
):
    shutil.rmtree(caches[0], ignore_errors=True)
    shutil.rmtree(caches[1], ignore_errors=True)
    elsewhere = _copy_model(model_dir, tmp_path / "mine" / "any-name")
    pair = group.addresses[:2]
    assert run(_generate(source, pair, requests, node_dir=str(elsewhere))) == reference
    assert [i.weights_fetch_total_bytes for i in run(node_infos(pair))] == [0, 0]
    assert not (caches[0] / source.digest).exists()
    # A different model under the same name at that path is not taken for it.
    lm_head = source.service.manifest.tensors["lm_head.weight"]
    _flip_byte(elsewhere / lm_head.file, lm_head.start)
    info = run(_load(group[1].address, source, ShardSpec(4, 8, False, True), str(elsewhere)))
    assert info.weights_fetch_total_bytes == shard_bytes(
        source.model_dir, ShardSpec(4, 8, False, True)
    )


def test_receive_buffers_are_reused_once_given_back() -> None:
    """A stream's chunks arrive in buffers handed back once written: a buffer is never given
    out twice before it comes back, a chunk larger than the buffers gets its own, and no more
    than `keep` wait for reuse."""
    buffers = bulk.ReceiveBuffers(size=16, keep=2)
    first, second = buffers.take(16), buffers.take(10)
    assert len(first) == 16 and len(second) == 10 and first.obj is not second.obj
    buffers.give(second)
    third = buffers.take(16)
    assert third.obj is second.obj and len(third) == 16  # reused, at the length asked for
    assert buffers.take(8).obj is not first.obj  # `first` is still out
    large = buffers.take(17)
    assert len(large) == 17
    for view in (first, third, large, buffers.take(4), buffers.take(4)):
        buffers.give(view)
    kept = {id(buffers.take(1).obj) for _ in range(3)}
    assert id(large.obj) not in kept and len(kept) == 3  # two kept for reuse, one new


# ---- bad input ----


def _fetch(port: int, request: pb.WeightsFetchRequest, token: str = nodes.TOKEN) -> list:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(
            FETCH_METHOD,
            request_serializer=pb.WeightsFetchRequest.SerializeToString,
            response_deserializer=decode_chunk,
        )
        return [bytes(m) for m in call(request, timeout=10, metadata=token_metadata(token))]


def _fetch_bulk(port: int, request: pb.WeightsFetchRequest, token: str = nodes.TOKEN) -> list:
    return [bytes(m) for m in bulk.fetch_pieces(("127.0.0.1", port), token, request)]


@pytest.mark.parametrize("transport", ["grpc", "bulk"])
@pytest.mark.parametrize(
    ("request_fields", "code", "says"),
    [
        ({"chunks": [("model.language_model.layers.6.mlp.up_proj.weight", 0)]},
         grpc.StatusCode.PERMISSION_DENIED, "not part of shard"),
        ({"chunks": [("no.such.tensor", 0)]}, grpc.StatusCode.NOT_FOUND, "no tensor"),
        ({"chunks": [("model.language_model.embed_tokens.weight", 9)]},
         grpc.StatusCode.OUT_OF_RANGE, "no chunk"),
        ({"files": ["../../../../etc/passwd"]}, grpc.StatusCode.PERMISSION_DENIED, "only the"),
        ({"files": ["model-00001-of-00002.safetensors"]},
         grpc.StatusCode.PERMISSION_DENIED, "only the"),
        ({"files": ["/etc/hostname"]}, grpc.StatusCode.PERMISSION_DENIED, "only the"),
        ({"model_digest": "sha256-0000"}, grpc.StatusCode.NOT_FOUND, "not sha256-0000"),
        ({"token": "wrong"}, grpc.StatusCode.UNAUTHENTICATED, "token"),
        ({"end": 99}, grpc.StatusCode.INVALID_ARGUMENT, "bad shard"),
    ],
)  # fmt: skip
def test_the_service_refuses_what_a_peer_may_not_read(
    source, transport, request_fields, code, says
):
    fields = dict(request_fields)
    token = fields.pop("token", nodes.TOKEN)
    chunks = fields.pop("chunks", [])
    fields = {"model_digest": source.digest, "start": 0, "end": 2, **fields}
    request = pb.WeightsFetchRequest(node_id="peer", is_head=True, **fields)
    request.chunks.extend(pb.WeightsChunkRef(tensor=t, chunk=c) for t, c in chunks)
    if transport == "bulk":  # the same checks and words, without gRPC's status codes
        with pytest.raises(bulk.BulkRefused, match=says):
            _fetch_bulk(source.service.bulk_port, request, token)
        return
    with pytest.raises(grpc.RpcError) as error:
        _fetch(source.port, request, token)
    assert error.value.code() == code
    assert says in error.value.details()


@pytest.mark.parametrize(
    ("hello", "says"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "bad magic"),
        (bulk.MAGIC + (2**20).to_bytes(4, "little"), "token of 1048576 bytes exceeds"),
        (bulk.MAGIC + b"\0\0\0\0" + (5).to_bytes(4, "little") + b"\xff" * 5, "malformed"),
    ],
)
def test_the_bulk_stream_refuses_a_malformed_hello(source, hello: bytes, says: str):
    with socket.create_connection(("127.0.0.1", source.service.bulk_port), timeout=10) as sock:
        sock.sendall(hello)
        answer = sock.makefile("rb").read()
    assert answer[:8] == bulk.LENGTH.pack(bulk.REFUSED)
    assert says in answer[12:].decode()


def test_the_bulk_stream_serves_what_grpc_serves(source, tmp_path):
    """A service without TLS offers the bulk stream and a fetcher takes it; either transport
    leaves the same verified files."""
    assert source.service.bulk_port
    spec = ShardSpec(0, 4, True, False)
    fetched = {}
    for use_bulk in (True, False):
        address = f"127.0.0.1:{source.port}"
        fetcher = ShardFetcher(
            address, nodes.TOKEN, node_id=f"bulk={use_bulk}", bulk_stream=use_bulk
        )
        try:
            manifest = fetcher.manifest(source.digest)
            path = fetcher.fetch_shard(WeightsStore(tmp_path / str(use_bulk)), manifest, spec)
            assert (fetcher.bulk_address is not None) is use_bulk
        finally:
            fetcher.close()
        model_files = [p for p in path.iterdir() if p.suffix in (".json", ".safetensors")]
        fetched[use_bulk] = {p.name: p.read_bytes() for p in model_files}
    assert fetched[True] == fetched[False]
    assert {"config.json", "model-00001-of-00002.safetensors"} <= set(fetched[True])


def test_a_model_directory_that_changes_mid_transfer_is_a_clear_error(
    group, model_dir, tmp_path, caches
):
    changing = _copy_model(model_dir, tmp_path / "changing" / model_dir.name)
    for moving in _serve(changing):
        (changing / "model-00001-of-00002.safetensors").touch()  # rewritten after hashing
        with pytest.raises(grpc.aio.AioRpcError) as error:
            run(_load(group[1].address, moving, ShardSpec(0, 4, True, False)))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "changed during the transfer" in error.value.details()


def test_a_full_cache_is_a_clear_error_and_nothing_is_loaded(group, source):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        run(_load(group[3].address, source, WHOLE))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "capped at" in error.value.details()
    assert not run(node_infos([group[3].address]))[0].HasField("shard")


# ---- the cache ----


def test_least_recently_used_models_are_evicted_and_listed(source, model_dir, tmp_path):
    other = _copy_model(model_dir, tmp_path / "other" / "tiny-b")
    lm_head = source.service.manifest.tensors["lm_head.weight"]
    _flip_byte(other / lm_head.file, lm_head.start)
    spec = ShardSpec(4, 8, False, True)
    need = shard_bytes(model_dir, spec)
    store = WeightsStore(tmp_path / "cache", cap_bytes=int(need * 1.5))

    def fetch(src: Source) -> None:
        fetcher = ShardFetcher(f"127.0.0.1:{src.port}", nodes.TOKEN, node_id="lru")
        try:
            fetcher.fetch_shard(store, fetcher.manifest(src.digest), spec)
        finally:
            fetcher.close()

    fetch(source)
    for second in _serve(other):
        fetch(second)
    listed = store.models()
    assert [m.name for m in listed] == ["tiny-b"]  # the first model made room for the second
    assert need <= listed[0].disk_bytes <= store.cap_bytes
    out = CliRunner().invoke(models_command, ["--cache-dir", str(store.root)])
    assert out.exit_code == 0, out.output
    assert "tiny-b" in out.output and listed[0].digest in out.output


def test_the_chunk_codec_is_protobufs():
    for size in (0, 1, 127, 128, 16383, 16384, 3 * 2**20 + 5):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        raw = encode_chunk(data)
        assert raw == pb.WeightsChunk(data=data).SerializeToString()
        assert bytes(decode_chunk(raw)) == data


def test_a_node_that_cannot_reach_the_bulk_port_fetches_over_grpc(source, tmp_path, monkeypatch):
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(source.service, "bulk_port", closed.getsockname()[1])
    fetcher = ShardFetcher(f"127.0.0.1:{source.port}", nodes.TOKEN, node_id="firewalled")
    try:
        manifest = fetcher.manifest(source.digest)
        assert fetcher.bulk_address is not None
        path = fetcher.fetch_shard(WeightsStore(tmp_path), manifest, ShardSpec(4, 8, False, True))
        assert fetcher.bulk_address is None  # gave up on it, and fetched over gRPC
        assert fetcher.progress.verified_bytes == fetcher.progress.total_bytes > 0
        assert (path / "config.json").is_file()
    finally:
        fetcher.close()


# ---- through the coordinator: placement, a node's death, progress ----


def test_after_a_node_dies_the_survivor_fetches_what_it_now_needs(
    node_factory, model_dir, source, tmp_path, requests, reference
):
    caches = [tmp_path / "a", tmp_path / "b"]
    pair = node_factory(2, args=lambda i: ["--cache-dir", str(caches[i])])
    bars = io.StringIO()

    async def go():
        coordinator = Coordinator(
            CoordinatorSettings(
                source.model_dir, nodes.TOKEN, use_all=True, node_model_dir=MISSING_DIR
            ),
            NodeDirectory(pair.addresses, browse=False),
        )
        progress = asyncio.create_task(asyncio.sleep(0))
        try:
            await coordinator.start(wait_for_nodes_s=20)
            progress = asyncio.create_task(coordinator.weights.show_progress(ProgressBars(bars)))
            head_end = coordinator.plan.stages[0].shard.end
            assert len(coordinator.plan.stages) == 2
            engine = coordinator.engine.engine
            first = [(await engine.generate(r)).tokens for r in requests]
            pair[1].kill()
            deadline = time.monotonic() + 30
            while (
                coordinator.plan.stages[0].shard.end != NUM_LAYERS or coordinator.pipeline.failure
            ):
                assert time.monotonic() < deadline, "the model was not re-placed"
                await asyncio.sleep(0.2)
            second = [(await engine.generate(r)).tokens for r in requests]
            await asyncio.sleep(0.6)  # one more frame of the bars
            return first, second, head_end
        finally:
            progress.cancel()
            await coordinator.close()

    first, second, head_end = run(go())
    assert first == second == reference
    info = run(node_infos([pair[0].address]))[0]
    head = ShardSpec(0, head_end, True, False)
    whole = shard_bytes(source.model_dir, WHOLE)
    # Only the layers it lacked (the embedding it had is not fetched again).
    assert info.weights_fetch_total_bytes == whole - shard_bytes(source.model_dir, head)
    assert "done" in bars.getvalue()


def test_the_node_reports_its_fetch_as_a_fraction():
    info = pb.NodeInfo(weights_fetched_bytes=25, weights_fetch_total_bytes=100)
    assert transfer_fraction(info) == 0.25
    done = pb.NodeInfo(weights_fetched_bytes=9, weights_fetch_total_bytes=9)
    assert transfer_fraction(done) is None
    assert transfer_fraction(pb.NodeInfo()) is None


def test_the_bars_show_each_transfer_to_a_node_to_its_end():
    transfers = Transfers()
    log, tty = io.StringIO(), _Terminal()
    bars = [ProgressBars(log), ProgressBars(tty)]
    for total in (100, 60):  # a load, then a re-placement's
        transfer = transfers.open("mac-1", total)
        for sent in (total // 2, total - total // 2):
            transfers.sent(transfer, sent)
            for bar in bars:
                bar.draw(transfers.snapshot(), time.monotonic())
        transfers.close(transfer)
        for bar in bars:
            bar.draw(transfers.snapshot(), time.monotonic())
        transfer.updated -= 2  # as if a while ago: the next open is a new transfer
    lines = log.getvalue().splitlines()
    assert [line.split()[-1] for line in lines if "done" in line] == ["done", "done"]
    assert " 50%" in lines[0] and "100.0/100.0 MiB" not in lines[0]
    assert tty.getvalue().count("done") == 2 and "\x1b[" in tty.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cluster_status_shows_a_node_fetching_its_weights():
    node = {
        "node_id": "mac-2", "address": "10.0.0.2:50151", "start": 4, "end": 8, "is_head": False,
        "is_tail": True, "up": True, "memory_used_bytes": 2**30, "memory_total_bytes": 2**34,
        "step_latency_ms": 0.0, "weights_fraction": 0.42,
    }  # fmt: skip
    body = json.dumps({"stats": {}, "nodes": [node, {**node, "weights_fraction": None}]})

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = CliRunner().invoke(status_command, ["--url", url])
    finally:
        server.shutdown()
    assert out.exit_code == 0, out.output
    rows = out.output.splitlines()[2:]
    assert rows[0].endswith("fetching weights 42%") and "fetching" not in rows[1]
