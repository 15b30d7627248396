"""A GPU's kernels built ahead, in parallel processes, while a node loads its shard.

MLX on CUDA compiles a kernel (with NVRTC, on one CPU core) the first time a process meets it,
and keeps what it compiled in a cache directory that the host's processes share
(`MLX_PTX_CACHE_DIR`, by default `$TMPDIR/mlx/<version>/ptx`). On a host whose cache is empty the
warm-up (`cluster.decode.warmup`) spends most of its time compiling, one kernel after the other:
on an H200 at the 27B shape, MLX's quantized matmul takes one kernel for steps of up to 16 rows a
request and one for more, over 30 s each, and the fused and custom kernels of the other steps 1-2
s each, so a warm-up of under a minute on a host that has them takes minutes on one that has not.

So where kernels are compiled on first use (`compiles_kernels`), a node starts `build_kernels`
beside its load: up to `default_workers()` processes, each of which loads a small copy of the
model at its real dimensions (the shard's first `full_attention_interval` layers, one of each
kind, with the embedding, the final norm, lm_head and MTP head; read from the node's checkpoint,
zeros for what it lacks) and runs its share of the warm-up's steps through a local pipeline
(`python -m cluster.decode.kernel_builds`). Kernels do not depend on how many layers a model
has, so what they compile is what the node's own warm-up then meets, and reads from the cache
instead. Each copy costs its weights in GPU memory (about 2 GB at the 27B shape at 4 bits).

What it guarantees:
- Nothing it does changes a result: it only fills the cache. A process that fails, or a build
  cut short, leaves the rest to the warm-up (logged, never raised).
- A node's processes write into a build directory of its own (seeded with links to what the
  host's cache held, so nothing there is built again; they share what they build), and each new
  file then moves into the host's cache whole (a rename, the kernel list before the kernel): a
  node reading the host's cache never meets a half-written file. (A build process may, as it
  reads one that another is writing: it then fails, and the warm-up builds what it had left.)
- A host that has built a plan's kernels once (a marker file in its cache names the plan) skips
  the build on every later load: a restart costs no process.

Metal ships its kernels compiled, and the CPU backend runs this project without its compiled
steps, so both skip it; `CLUSTER_KERNEL_BUILDS=0` in a node's environment turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from cluster.config import load_model_config
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.warmup import Driven, WarmupArgs, WarmupProgress, WarmupStep, run_warmup
from cluster.decode.worker import MLXWorker
from cluster.model.footprint import ModelFootprint
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec

log = logging.getLogger(__name__)

# Each process holds a small copy of the model and a CUDA context (about 2 GB of GPU memory at the
# 27B shape); more than this many gain little, as the warm-up has about 17 steps.
MAX_WORKERS = 8
# Set to 0, no node builds kernels ahead (its warm-up builds them, one after the other).
SWITCH = "CLUSTER_KERNEL_BUILDS"
NOT_COMPILED_HERE = "kernels here are not compiled at first use"
CONTEXT_BYTES = 1 << 30  # a process's CUDA context and MLX's own buffers, about
# A build process still running after this long is stopped: the warm-up builds what it had left.
DEADLINE_S = 300.0


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """What a node's warm-up will run: the plan of `warmup` for the checkpoint at `model_dir`
    in `dtype` ("": as stored), on a shard of the half-open layer range `layers`."""

    model_dir: str
    dtype: str
    warmup: WarmupArgs
    layers: tuple[int, int]

    def key(self) -> str:
        """The plan's name in a host's cache: its warm-up, the model's config and MLX's
        version (kernels of another build of MLX are not these), not its layers (a kernel
        serves every layer of its kind)."""
        config = (Path(self.model_dir) / "config.json").read_bytes()
        fields = json.dumps([self.dtype, asdict(self.warmup)]).encode()
        digest = hashlib.sha256(fields + config + mx.__version__.encode()).hexdigest()
        return digest[:16]

    def steps(self) -> list[WarmupStep]:
        return self.warmup.plan(load_model_config(self.model_dir).max_context)

    def as_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KernelPlan:
        fields = json.loads(text)
        warmup, layers = WarmupArgs(**fields["warmup"]), tuple(fields["layers"])
        return cls(fields["model_dir"], fields["dtype"], warmup, layers)


@dataclass(frozen=True, slots=True)
class KernelBuildReport:
    """What one `build_kernels` did: `workers` processes (0: skipped, and `skipped` says why),
    `failed` of which ended in error, for `seconds`; `new_files`: files it added to the cache."""

    workers: int
    seconds: float
    new_files: int = 0
    failed: int = 0
    skipped: str = ""

    @property
    def applies(self) -> bool:
        """Whether this backend builds kernels at first use at all (what is worth showing)."""
        return self.skipped != NOT_COMPILED_HERE

    def line(self) -> str:
        if self.skipped:
            return f"kernel builds skipped: {self.skipped}"
        failed = f", {self.failed} failed" if self.failed else ""
        processes = "process" if self.workers == 1 else "processes"
        return (
            f"kernels built ahead in {self.seconds:.1f} s by {self.workers} {processes}"
            f" ({self.new_files} new files{failed})"
        )


def compiles_kernels() -> bool:
    """Whether MLX compiles this host's GPU kernels at first use: MLX on CUDA."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def host_cache_dir() -> Path:
    """Where MLX on CUDA keeps the kernels it compiled, as MLX itself resolves it."""
    if configured := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(configured)
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def default_workers() -> int:
    """Half the CPU cores (a compile takes one; the node loads beside them), at most
    MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) // 2))


def workers_within(plan: KernelPlan, free_bytes: int) -> int:
    """`default_workers()`, fewer where their copies of the model would take more than half
    of `free_bytes` (the device's memory that the node's own shard leaves): each costs its copy's
    weights half again (activations, caches) and a CUDA context; 0 where not one fits."""
    footprint = ModelFootprint.from_dir(plan.model_dir)
    start, end = plan.layers
    layers = sum(footprint.layer_weight_bytes[start : min(end, start + _kind_span(plan))])
    per_worker = 1.5 * (layers + footprint.extra_bytes(is_head=True, is_tail=True)) + CONTEXT_BYTES
    return min(default_workers(), int(max(free_bytes, 0) / 2 // per_worker))


def _kind_span(plan: KernelPlan) -> int:
    """Layers of the small copy: one of each kind (attention every this many)."""
    return load_model_config(plan.model_dir).text.full_attention_interval


def share_steps(total: int, workers: int) -> list[list[int]]:
    """The warm-up's step indices dealt to `workers` processes in turn: the costly first steps
    of each kind (a prompt's first chunk over 16 rows, a batch's first verify step) land on
    different processes."""
    workers = max(1, min(workers, total))
    return [list(range(i, total, workers)) for i in range(workers)]


async def build_kernels(
    plan: KernelPlan,
    *,
    workers: int | None = None,
    free_bytes: int | None = None,
    cache_dir: Path | None = None,
    deadline_s: float = DEADLINE_S,
    force: bool = False,
) -> KernelBuildReport:
    """Run `plan`'s warm-up steps in parallel processes that fill the host's kernel cache
    (`cache_dir`, None: MLX's): `workers` of them (None: as many as `free_bytes` of device
    memory holds, `workers_within`; with neither, `default_workers()`), unless kernels are
    not compiled here or the host built this plan already (`force`: on any backend).
    Processes still running after `deadline_s` are stopped, what they built kept. Never
    raises for a failed build."""
    if os.environ.get(SWITCH, "1") == "0":
        return KernelBuildReport(0, 0.0, skipped=f"turned off ({SWITCH}=0)")
    if not force and not compiles_kernels():
        return KernelBuildReport(0, 0.0, skipped=NOT_COMPILED_HERE)
    started = time.monotonic()
    cache = cache_dir or host_cache_dir()
    try:
        marker = cache / f"kernel-plan-{plan.key()}.built"
        if marker.exists():
            return KernelBuildReport(0, 0.0, skipped="this host built them at an earlier load")
        if workers is None:
            workers = default_workers() if free_bytes is None else workers_within(plan, free_bytes)
        if workers < 1:
            return KernelBuildReport(0, 0.0, skipped="no device memory for a copy of the model")
        shares = share_steps(len(plan.steps()), workers)
        cache.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f"{cache.name}-build-", dir=cache.parent))
    except (OSError, ValueError) as error:  # no cache directory; a checkpoint it cannot read
        return KernelBuildReport(0, 0.0, skipped=f"cannot build: {error}")
    try:
        _link_all(cache, build)
        runs = [asyncio.ensure_future(_run_worker(plan, share, build)) for share in shares]
        late = set(runs)  # all of them where the build itself is cancelled (a failed load)
        try:
            done, late = await asyncio.wait(runs, timeout=deadline_s)
        finally:
            for run in late:  # killed (`_run_worker`); what they built so far is kept
                run.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        failed = len(late) + sum(not run.result() for run in done)
        new_files = merge_into(build, cache)
        if not failed:
            marker.touch()
        return KernelBuildReport(len(shares), time.monotonic() - started, new_files, failed)
    except OSError as error:
        log.info("kernel builds cut short (%s): the warm-up builds the rest", error)
        return KernelBuildReport(0, time.monotonic() - started, skipped=str(error))
    finally:
        shutil.rmtree(build, ignore_errors=True)


def merge_into(build: Path, cache: Path) -> int:
    """Move the files of `build` that `cache` lacks into it, each whole, a module's kernel list
    (`.txt`) and source before its kernel (`.ptx`, which is what MLX looks for first); returns
    how many moved."""
    moved = 0
    new = [f for f in build.iterdir() if f.is_file() and not (cache / f.name).exists()]
    for path in sorted(new, key=lambda f: f.suffix == ".ptx"):
        os.replace(path, cache / path.name)
        moved += 1
    return moved


def _link_all(cache: Path, build: Path) -> None:
    """`build` holds what `cache` holds (hard links: MLX only ever writes a kernel it did not
    find, so a linked file is never written through)."""
    for path in cache.iterdir():
        if path.is_file():
            try:
                os.link(path, build / path.name)
            except OSError:  # another filesystem, or gone meanwhile: copy what is there
                with contextlib.suppress(OSError):
                    shutil.copy2(path, build / path.name)


async def _run_worker(plan: KernelPlan, steps: list[int], build: Path) -> bool:
    """One process running `steps` of the plan with `build` as its kernel cache; whether it
    ended well."""
    job = json.dumps({"plan": plan.as_json(), "steps": steps})
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(build)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cluster.decode.kernel_builds", job,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, stderr = await process.communicate()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
        log.info("a kernel build process ended with %s: %s", process.returncode, " | ".join(tail))
    return process.returncode == 0


async def run_share(plan: KernelPlan, steps: list[int]) -> list[Driven]:
    """In a build process: load the model's small copy and run `steps` of the plan's warm-up
    through it; returns what each step drove."""
    config = load_model_config(plan.model_dir)
    end = min(plan.layers[1], plan.layers[0] + _kind_span(plan))
    spec = ShardSpec(plan.layers[0], end, is_head=True, is_tail=True)
    dtype = getattr(mx, plan.dtype) if plan.dtype else None
    worker = MLXWorker(spin_s=0.0)
    shard = await worker.run(
        load_shard, plan.model_dir, spec, dtype=dtype, for_decoding=True, fill_missing=True
    )
    pipeline = LocalPipeline([ShardRunner(shard)], worker, max_context=config.max_context)
    every = plan.steps()
    progress = WarmupProgress()
    await run_warmup(
        pipeline,
        [every[i] for i in steps],
        prefill_chunk=plan.warmup.prefill_chunk,
        vocab_size=config.text.vocab_size,
        progress=progress,
    )
    return progress.driven


def main(argv: list[str]) -> int:
    """`python -m cluster.decode.kernel_builds JOB`: JOB is `{"plan": KernelPlan.as_json(),
    "steps": [indices of its steps]}`; prints what each step drove, as JSON lines."""
    job = json.loads(argv[0])
    plan = KernelPlan.from_json(job["plan"])
    for driven in asyncio.run(run_share(plan, job["steps"])):
        print(json.dumps(asdict(driven)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
