"""Weights to a node over loopback, against a plain file copy of the same bytes.

    python -m benchmarks.weights_bench [--json OUT] [--rounds 3] [--hidden 1024]

A synthetic Qwen3.5 checkpoint (the bundled model's config, widened to --hidden; random bf16
bytes; several hundred MiB) is served by the coordinator's Weights service in a subprocess,
as `cluster coordinator` serves it. Each round, in shuffled order, measures on the same bytes:
  copy        shutil.copyfile of each safetensors file (the target: transfer >= 0.5x of it)
  bare grpc   a minimal Python gRPC server stream of 4 MiB raw messages, written with pwrite
              and not verified (what gRPC alone costs on this machine)
  fetch xN    the product path: `ShardFetcher.fetch_shard` of the whole model into an empty
              cache, N parallel streams, every chunk's digest verified before it is written;
              the chunks come over the service's bulk TCP stream (`cluster.weights.bulk`)
  fetch grpc x1  the same over the gRPC stream (what a TLS cluster uses)
and the serving process's peak RSS growth during each transfer (VmHWM, reset before each),
against the chunk size: the service holds a few chunks per stream, never a file. All in the
page cache (warm), as the copy is; medians over --rounds. `--dir /dev/shm` puts the model and
the copies on tmpfs (no disk writeback in any figure).
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

from benchmarks.common import default_model, machine, median, write_json
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
        offset, end = map(int, request.split(b","))
        fd = os.open(model_file, os.O_RDONLY)
        try:
            while offset < end:
                data = os.pread(fd, min(CHUNK_BYTES, end - offset), offset)
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
    print(json.dumps({"port": port, "bare_port": bare_port}), flush=True)
    for line in sys.stdin:  # until the parent closes it
        if line.strip() == "reset":  # start a new peak (Linux: 5 clears VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        cpu = os.times()
        memory = {"peak_kb": _status_kb("VmHWM"), "rss_kb": _status_kb("VmRSS")}
        print(json.dumps({**memory, "cpu_s": cpu.user + cpu.system}), flush=True)
    server.stop(None)
    bare.stop(None)


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---- the measured variants ----


def run_copy(model_dir: Path, out: Path) -> None:
    shutil.copyfile(model_dir / "model.safetensors", out / "copy.safetensors")


def run_bare(port: int, size: int, out: Path, streams: int) -> None:
    """Each stream a byte range of the file, over its own connection, written as it comes."""
    from cluster.weights.service import weights_grpc_options

    options = [*weights_grpc_options(), ("grpc.use_local_subchannel_pool", 1)]
    fd = os.open(out / "bare.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
    part = -(-size // streams)

    def one(i: int) -> None:
        offset, end = i * part, min(size, (i + 1) * part)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream(BARE_METHOD, lambda b: b, lambda b: b)
            for data in call(f"{offset},{end}".encode()):
                offset += os.pwrite(fd, data, offset)

    try:
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, range(streams)))
    finally:
        os.close(fd)


def run_fetch(port: int, digest: str, out: Path, streams: int, bulk_stream: bool = True) -> int:
    from cluster.model.shard import ShardSpec
    from cluster.weights.fetch import ShardFetcher
    from cluster.weights.store import WeightsStore

    address = f"127.0.0.1:{port}"
    fetcher = ShardFetcher(
        address, TOKEN, node_id="bench", streams=streams, bulk_stream=bulk_stream
    )
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
    parser.add_argument(
        "--dir", default=None, help="Where the model and the copies go [default: the temp dir]."
    )
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(prefix="weights-bench-", dir=args.dir) as tmp:
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
        [sys.executable, "-m", "benchmarks.weights_bench", "--serve", str(model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = json.loads(server.stdout.readline())
        size = (model_dir / "model.safetensors").stat().st_size
        variants = {
            "copy": lambda out: run_copy(model_dir, out),
            **{
                f"bare grpc x{n}": (lambda out, n=n: run_bare(hello["bare_port"], size, out, n))
                for n in (1, 2)
            },
            **{
                f"fetch x{n}": (lambda out, n=n: run_fetch(hello["port"], digest, out, n))
                for n in (1, 2, 4)
            },
            "fetch grpc x1": (
                lambda out: run_fetch(hello["port"], digest, out, 1, bulk_stream=False)
            ),
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        peaks: dict[str, list[int]] = {name: [] for name in variants}
        cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}  # s/MiB

        def ask(command: str) -> dict:
            server.stdin.write(command + "\n")
            server.stdin.flush()
            return json.loads(server.stdout.readline())

        order = list(variants)
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                out = tmp / "out"
                out.mkdir()
                before = ask("reset")
                mine = _cpu_s()
                started = time.perf_counter()
                variants[name](out)
                seconds[name].append(time.perf_counter() - started)
                mine = _cpu_s() - mine
                after = ask("peak")
                peaks[name].append((after["peak_kb"] - before["rss_kb"]) * 1024)
                mib = total / 2**20
                cpu[name].append(((after["cpu_s"] - before["cpu_s"]) / mib, mine / mib))
                shutil.rmtree(out)
        server.stdin.close()
    finally:
        server.wait(timeout=30)
    rates = {name: total / median(s) / 2**20 for name, s in seconds.items()}
    report = {
        "machine": machine(),
        "dir": str(tmp),
        "model_bytes": total,
        "chunk_bytes": CHUNK_BYTES,
        "manifest_hash_s": hash_s,
        "seconds": seconds,
        "mib_per_s": rates,
        "vs_copy": {name: rate / rates["copy"] for name, rate in rates.items()},
        "server_peak_rss_growth_bytes": {name: max(p) for name, p in peaks.items()},
        "cpu_ms_per_mib": {
            name: {
                "server": 1000 * median(s for s, _ in v),
                "client": 1000 * median(c for _, c in v),
            }
            for name, v in cpu.items()
        },
    }
    print(f"model {total / 2**20:.0f} MiB, chunk {CHUNK_BYTES / 2**20:.0f} MiB, "
          f"manifest hashed in {hash_s:.2f} s")  # fmt: skip
    print(f"{'':<15} {'MiB/s':>8} {'vs copy':>8} {'CPU ms/MiB server, client':>26} "
          f"{'server peak RSS growth':>24}")  # fmt: skip
    for name in variants:
        peak = max(peaks[name])
        c = report["cpu_ms_per_mib"][name]
        print(f"{name:<15} {rates[name]:8.0f} {report['vs_copy'][name]:7.2f}x "
              f"{c['server']:15.2f} {c['client']:10.2f} "
              f"{peak / 2**20:12.1f} MiB = {peak / CHUNK_BYTES:4.1f} chunks")  # fmt: skip
    return report


if __name__ == "__main__":
    main()
