"""A node's weights cache: one directory per model (named by its digest), a size cap, LRU eviction.

Each cached model is a model directory that `load_shard` reads as it is: the small files it
needs (config.json, the index; nodes never tokenize) and every safetensors file at its full
size, its header in place and only the node's tensors written, at their own offsets (the file
is sparse: what was never fetched takes no disk). `chunks.log` lists the chunks written; it is
only a hint: a chunk counts as present once its bytes, read back from the file, hash to the
manifest (a verified read), so a torn write or a byte flipped on disk is found and fetched
again, never loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cluster.weights.manifest import (
    HASH_THREADS,
    Manifest,
    ManifestError,
    chunk_count,
    content_digest,
)

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
CHUNK_LOG = "chunks.log"
USED_MARK = ".last-used"
# The small files a node needs to load a shard (nodes never tokenize: no tokenizer files).
NODE_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")

ChunkRef = tuple[str, int]  # (tensor name, chunk index)


class CacheFullError(OSError):
    """The cache (its cap, or the disk under it) cannot hold what a shard needs."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cluster" / "models"


def allocated_bytes(path: Path) -> int:
    """Disk blocks actually used under `path` (sparse files count only what was written)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


@dataclass(frozen=True, slots=True)
class CachedModelSummary:
    digest: str
    name: str
    disk_bytes: int  # allocated on disk
    model_bytes: int  # every tensor of the model
    present_bytes: int  # tensors listed as written (not re-verified here)
    last_used: float  # epoch seconds


class CachedModel:
    """One model's directory in the cache; safe to write from several fetch threads."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- layout ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the directory, the manifest and the sparse weight files (idempotent)."""
        self.path.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path / MANIFEST_FILE, self.manifest.to_json())
        for wf in self.manifest.weight_files.values():
            target = self.path / wf.name
            fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != wf.size:
                    os.ftruncate(fd, wf.size)
                if os.pread(fd, len(wf.header), 0) != wf.header:
                    _pwrite_all(fd, wf.header, 0)
            finally:
                os.close(fd)
        self.touch()

    def touch(self) -> None:
        (self.path / USED_MARK).write_text(str(time.time()))

    # -- small files -----------------------------------------------------------------------

    def missing_small_files(self) -> list[str]:
        out = []
        for sf in self.manifest.small_files.values():
            if sf.name not in NODE_FILES:
                continue
            try:
                data = (self.path / sf.name).read_bytes()
            except FileNotFoundError:
                out.append(sf.name)
                continue
            if content_digest(data) != sf.digest:
                out.append(sf.name)
        return out

    def write_small_file(self, name: str, data: bytes | memoryview) -> None:
        expected = self.manifest.small_files[name].digest
        if content_digest(data) != expected:
            raise ManifestError(f"file {name!r} does not match the manifest")
        _write_atomic(self.path / name, bytes(data))

    # -- chunks ----------------------------------------------------------------------------

    def chunks_of(self, tensors: list[str]) -> list[ChunkRef]:
        cb = self.manifest.chunk_bytes
        return [
            (t, i) for t in tensors for i in range(chunk_count(self.manifest.tensors[t].nbytes, cb))
        ]

    def chunk_hash_ok(self, ref: ChunkRef, data: bytes | memoryview) -> bool:
        tensor, index = ref
        return content_digest(data) == self.manifest.tensors[tensor].chunk_hashes[index]

    def missing_chunks(self, tensors: list[str]) -> list[ChunkRef]:
        """The chunks of `tensors` without a verified copy here (a verified read of each
        chunk the log lists; what the log does not list is missing without reading it)."""
        logged = self._logged()
        wanted = self.chunks_of(tensors)
        candidates = [ref for ref in wanted if ref in logged]
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            good = list(pool.map(self._verify_on_disk, candidates))
        present = {ref for ref, ok in zip(candidates, good, strict=True) if ok}
        bad = [ref for ref, ok in zip(candidates, good, strict=True) if not ok]
        if bad:
            log.warning(
                "%d cached chunk(s) of %s fail their hash (first: %s #%d); fetching again",
                len(bad),
                self.manifest.name or self.manifest.digest,
                *bad[0],
            )
        return [ref for ref in wanted if ref not in present]

    def write_chunk(self, ref: ChunkRef, data: bytes | memoryview) -> None:
        """Write a chunk whose hash the caller verified, then log it."""
        tensor, index = ref
        entry = self.manifest.tensors[tensor]
        offset, length = entry.chunk_range(index, self.manifest.chunk_bytes)
        if len(data) != length:
            raise ManifestError(f"chunk {tensor} #{index}: {len(data)} bytes, expected {length}")
        try:
            _pwrite_all(self._fd(entry.file), data, offset)
            with self._lock, open(self.path / CHUNK_LOG, "a") as chunk_log:
                chunk_log.write(json.dumps([tensor, index]) + "\n")
        except OSError as error:
            if error.errno in (28, 122):  # ENOSPC, EDQUOT
                raise CacheFullError(
                    error.errno, f"the node's disk is full under {self.path}: {error.strerror}"
                ) from None
            raise

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(self.path / file, os.O_RDWR)
            return fd

    def _logged(self) -> set[ChunkRef]:
        logged = set()
        try:
            lines = (self.path / CHUNK_LOG).read_text().splitlines()
        except FileNotFoundError:
            return logged
        for line in lines:
            with contextlib.suppress(ValueError, TypeError):  # a torn last line
                tensor, index = json.loads(line)
                logged.add((str(tensor), int(index)))
        return logged

    def _verify_on_disk(self, ref: ChunkRef) -> bool:
        tensor, index = ref
        entry = self.manifest.tensors.get(tensor)
        if entry is None:
            return False
        offset, length = entry.chunk_range(index, self.manifest.chunk_bytes)
        fd = os.open(self.path / entry.file, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return len(data) == length and self.chunk_hash_ok(ref, data)


class WeightsStore:
    """The cache directory of a node: `<root>/<digest>/` per model, at most `cap_bytes`."""

    def __init__(self, root: Path, cap_bytes: int | None = None):
        self.root = Path(root)
        self.cap_bytes = cap_bytes

    def model(self, manifest: Manifest) -> CachedModel:
        cached = CachedModel(self.root / manifest.digest, manifest)
        cached.prepare()
        return cached

    def cached_manifest(self, digest: str) -> Manifest | None:
        """The manifest of a model in the cache, if it is there and is what its name says."""
        try:
            data = (self.root / digest / MANIFEST_FILE).read_bytes()
            return Manifest.from_json(data, expect_digest=digest)
        except (OSError, ManifestError):
            return None

    def models(self) -> list[CachedModelSummary]:
        out = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.iterdir()):
            manifest = self.cached_manifest(path.name) if path.is_dir() else None
            if manifest is None:
                continue
            cached = CachedModel(path, manifest)
            present = {t for t, _ in cached._logged() if t in manifest.tensors}
            out.append(
                CachedModelSummary(
                    digest=manifest.digest,
                    name=manifest.name,
                    disk_bytes=allocated_bytes(path),
                    model_bytes=manifest.total_bytes,
                    present_bytes=manifest.tensor_bytes(present),
                    last_used=_last_used(path),
                )
            )
        return out

    def usage_bytes(self) -> int:
        return allocated_bytes(self.root) if self.root.is_dir() else 0

    def make_room(self, need_bytes: int, keep: str) -> None:
        """Evict least recently used models (never `keep`) until `need_bytes` more fit
        under the cap; raise CacheFullError if they cannot."""
        if self.cap_bytes is None:
            return
        while self.usage_bytes() + need_bytes > self.cap_bytes:
            others = [m for m in self.models() if m.digest != keep]
            if not others:
                raise CacheFullError(
                    28,
                    f"the weights cache {self.root} is capped at {_gb(self.cap_bytes)}; the "
                    f"shard needs {_gb(need_bytes)} more and {_gb(self.usage_bytes())} is in use",
                )
            victim = min(others, key=lambda m: m.last_used)
            log.info("evicting %s (%s) from the weights cache", victim.name, victim.digest)
            shutil.rmtree(self.root / victim.digest, ignore_errors=True)


def _last_used(path: Path) -> float:
    try:
        return float((path / USED_MARK).read_text())
    except (OSError, ValueError):
        return 0.0


def _gb(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
