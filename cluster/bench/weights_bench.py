"""Weights to a node over loopback, against a plain file copy of the same bytes.

    python -m cluster.bench.weights_bench [--json OUT] [--rounds 3] [--hidden 1024]

A synthetic Qwen3.5 checkpoint (the bundled model's config, widened to --hidden; random bf16
bytes; several hundred MiB) is served by the coordinator's Weights service in a subprocess,
as `cluster coordinator` serves it. Each round, in shuffled order, measures on the same bytes:
  copy        shutil.copyfile of each safetensors file (the target: transfer >= 0.5x of it)
  bare grpc   a minimal Python gRPC server stream of 4 MiB raw messages, written with pwrite
              and not verified (what gRPC alone costs on this machine)
  fetch xN    the product path: `ShardFetcher.fetch_shard` of the whole model into an empty
              cache, N parallel streams, every chunk SHA-256 verified before it is written
and the serving process's peak RSS growth over the whole run (VmHWM), against the chunk size:
the service holds about one chunk per stream, never a file. All in the page cache (warm), as
the copy is; medians over --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cluster.bench.common import default_model, machine, median, write_json
from cluster.weights.manifest import CHUNK_BYTES

TOKEN = "weights-bench"
BARE_METHOD = "/bench.Bare/Stream"


# ---- the synthetic model ----


def make_model(dest: Path, hidden: int, vocab: int) -> int:
    """Write a checkpoint shaped like the bundled model but wider; returns its tensor bytes."""
    from mlx.utils import tree_flatten

    from cluster.config import load_model_config
    from cluster.model.shard import ModelShard, ShardSpec

    dest.mkdir(parents=True)
    raw = json.loads((default_model() / "config.json").read_text())
    raw["text_config"].update(hidden_size=hidden, intermediate_size=4 * hidden, vocab_size=vocab)
    (dest / "config.json").write_text(json.dumps(raw))
    config = load_model_config(dest)
    shard = ModelShard(config, ShardSpec.whole(config.num_layers), with_mtp=True)
    params = sorted(tree_flatten(shard.parameters()), key=lambda kv: kv[0])
    header, offset, files = {}, 0, {}
    for name, value in params:
        key = name if name.startswith("mtp.") else (
            "language_model." + name if name.startswith("lm_head.") else
            "language_model.model." + name
        )  # fmt: skip
        nbytes = value.size * 2
        header[key] = {"dtype": "BF16", "shape": list(value.shape),
                       "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        files[key] = "model.safetensors"
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        left = offset
        while left:
            n = min(left, 64 * 2**20)
            f.write(os.urandom(n))
            left -= n
    index = {"metadata": {"total_size": offset}, "weight_map": files}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return offset


# ---- the serving subprocess: the product service and a bare gRPC stream ----


def _bare_handler(model_file: Path) -> grpc.GenericRpcHandler:
    def stream(request: bytes, context):
        fd = os.open(model_file, os.O_RDONLY)
        try:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                data = os.pread(fd, CHUNK_BYTES, offset)
                offset += len(data)
                yield data
        finally:
            os.close(fd)

    return grpc.method_handlers_generic_handler(
        "bench.Bare",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)},
    )


def serve(model_dir: Path) -> None:
    from cluster.weights.service import WeightsService, serve_weights, weights_grpc_options

    service = WeightsService(model_dir, TOKEN)
    server, port = serve_weights(service, "127.0.0.1", 0)
    bare = grpc.server(ThreadPoolExecutor(4), options=weights_grpc_options())
    bare.add_generic_rpc_handlers((_bare_handler(model_dir / "model.safetensors"),))
    bare_port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    print(json.dumps({"port": port, "bare_port": bare_port, "rss_kb": _status_kb("VmRSS")}))
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes it
    print(json.dumps({"peak_kb": _status_kb("VmHWM"), "rss_kb": _status_kb("VmRSS")}))
    sys.stdout.flush()
    server.stop(None)
    bare.stop(None)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---- the measured variants ----


def run_copy(model_dir: Path, out: Path) -> None:
    shutil.copyfile(model_dir / "model.safetensors", out / "copy.safetensors")


def run_bare(port: int, out: Path) -> None:
    from cluster.weights.service import weights_grpc_options

    fd = os.open(out / "bare.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
    offset = 0
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=weights_grpc_options()) as channel:
        call = channel.unary_stream(BARE_METHOD, lambda b: b, lambda b: b)
        for data in call(b""):
            offset += os.pwrite(fd, data, offset)
    os.close(fd)


def run_fetch(port: int, digest: str, out: Path, streams: int) -> int:
    from cluster.model.shard import ShardSpec
    from cluster.weights.fetch import ShardFetcher
    from cluster.weights.store import WeightsStore

    fetcher = ShardFetcher(f"127.0.0.1:{port}", TOKEN, node_id="bench", streams=streams)
    try:
        store = WeightsStore(out / f"cache-{streams}")
        manifest = fetcher.manifest(digest)
        fetcher.fetch_shard(store, manifest, ShardSpec.whole(8))
        return fetcher.progress.verified_bytes
    finally:
        fetcher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as tmp:
        report = measure(Path(tmp), args)
    write_json(args.json, report)


def measure(tmp: Path, args: argparse.Namespace) -> dict:
    from cluster.weights.manifest import manifest_for

    model_dir = tmp / "model"
    total = make_model(model_dir, args.hidden, args.vocab)
    started = time.perf_counter()
    digest = manifest_for(model_dir).digest  # hashed once here; the service reads the cache
    hash_s = time.perf_counter() - started
    server = subprocess.Popen(
        [sys.executable, "-m", "cluster.bench.weights_bench", "--serve", str(model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = json.loads(server.stdout.readline())
        variants = {
            "copy": lambda out: run_copy(model_dir, out),
            "bare grpc": lambda out: run_bare(hello["bare_port"], out),
            **{
                f"fetch x{n}": (lambda out, n=n: run_fetch(hello["port"], digest, out, n))
                for n in (1, 4)
            },
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        order = list(variants)
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                out = tmp / "out"
                out.mkdir()
                started = time.perf_counter()
                variants[name](out)
                seconds[name].append(time.perf_counter() - started)
                shutil.rmtree(out)
        server.stdin.close()
        bye = json.loads(server.stdout.readline())
    finally:
        server.wait(timeout=30)
    peak_growth = (bye["peak_kb"] - hello["rss_kb"]) * 1024
    rates = {name: total / median(s) / 2**20 for name, s in seconds.items()}
    report = {
        "machine": machine(),
        "model_bytes": total,
        "chunk_bytes": CHUNK_BYTES,
        "manifest_hash_s": hash_s,
        "seconds": seconds,
        "mib_per_s": rates,
        "vs_copy": {name: rate / rates["copy"] for name, rate in rates.items()},
        "service_peak_rss_growth_bytes": peak_growth,
    }
    print(f"model {total / 2**20:.0f} MiB, chunk {CHUNK_BYTES / 2**20:.0f} MiB, "
          f"manifest hashed in {hash_s:.2f} s")  # fmt: skip
    for name in variants:
        print(f"{name:<12} {rates[name]:8.0f} MiB/s  {report['vs_copy'][name]:5.2f}x copy")
    print(f"service peak RSS growth over the run: {peak_growth / 2**20:.1f} MiB "
          f"({peak_growth / CHUNK_BYTES:.1f} chunks)")  # fmt: skip
    return report


if __name__ == "__main__":
    main()
