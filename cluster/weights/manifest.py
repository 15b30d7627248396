"""A model named by its content: every tensor's place, shape and chunk hashes, and the small files.

The manifest of a model directory lists each tensor of its safetensors files (file, absolute byte
range, dtype, shape, a BLAKE3 digest per chunk of CHUNK_BYTES), each safetensors file's header (so a
node can rebuild the file around only the tensors it holds), and the small files a node needs to
load a shard (config.json, tokenizer files, the index) with their hashes. Its digest, a hash of
its canonical JSON, is the model's name: the same bytes at two paths are one model, and two
different models in directories of the same name are two.

Hashing a model is one read of it; the result is cached beside the directory (or in the user's
cache when the directory is read-only) and reused while no file's size or mtime changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20  # part of the manifest (its hashes depend on it): one value cluster-wide
MANIFEST_VERSION = 2  # 2: BLAKE3 digests (1: SHA-256)
CACHE_NAME = ".cluster-manifest.json"
SMALL_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".md")
SMALL_FILE_MAX_BYTES = 64 * 2**20
SAFETENSORS_HEADER_MAX = 100 * 2**20  # what the safetensors format itself allows
HASH_THREADS = min(8, os.cpu_count() or 1)


def content_digest(data: bytes | memoryview) -> str:
    """The digest that a manifest lists for a chunk or a small file, and that a node checks
    each received chunk against. BLAKE3: several times SHA-256's speed on one core, where
    hashing is most of a node's time to verify what it receives, and like hashlib it releases
    the GIL, so the pool's threads hash side by side."""
    return blake3.blake3(data).hexdigest()


class ManifestError(ValueError):
    """A model directory that cannot be described (names the file), or a manifest that is not
    what its digest says."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    file: str
    start: int  # absolute byte offsets in `file`, half-open
    end: int
    dtype: str
    shape: tuple[int, ...]
    chunk_hashes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def chunk_range(self, index: int, chunk_bytes: int) -> tuple[int, int]:
        """(file offset, length) of chunk `index`."""
        offset = self.start + index * chunk_bytes
        return offset, min(chunk_bytes, self.end - offset)


@dataclass(frozen=True, slots=True)
class WeightFile:
    name: str
    size: int
    header: bytes  # the first 8 + N bytes: length prefix and JSON header


@dataclass(frozen=True, slots=True)
class SmallFile:
    name: str
    size: int
    digest: str  # content_digest


@dataclass(frozen=True, slots=True)
class Manifest:
    chunk_bytes: int
    tensors: dict[str, TensorEntry]
    weight_files: dict[str, WeightFile]
    small_files: dict[str, SmallFile]
    digest: str
    name: str = ""  # the directory's name where it was made: shown, never compared

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def tensor_bytes(self, names: list[str] | set[str]) -> int:
        return sum(self.tensors[n].nbytes for n in names)

    def to_json(self) -> bytes:
        return json.dumps({**_content(self), "name": self.name}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, expect_digest: str | None = None) -> Manifest:
        try:
            raw = json.loads(data)
            manifest = _from_content(raw, name=raw.get("name", ""))
        except (ValueError, KeyError, TypeError) as error:
            raise ManifestError(f"malformed manifest: {error}") from None
        if expect_digest and manifest.digest != expect_digest:
            raise ManifestError(
                f"manifest content hashes to {manifest.digest}, not the asked {expect_digest}"
            )
        return manifest


def _content(m: Manifest) -> dict:
    """What the digest covers: everything but the directory's name."""
    return {
        "version": MANIFEST_VERSION,
        "chunk_bytes": m.chunk_bytes,
        "tensors": {
            n: [t.file, t.start, t.end, t.dtype, list(t.shape), list(t.chunk_hashes)]
            for n, t in m.tensors.items()
        },
        "weight_files": {
            n: [f.size, f.header.decode("latin-1")] for n, f in m.weight_files.items()
        },
        "small_files": {n: [f.size, f.digest] for n, f in m.small_files.items()},
    }


def _digest(content: dict) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return "sha256-" + hashlib.sha256(canonical).hexdigest()[:32]


def _from_content(raw: dict, name: str = "") -> Manifest:
    if raw.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {raw.get('version')!r} is not {MANIFEST_VERSION}")
    tensors = {
        n: TensorEntry(n, f, int(s), int(e), d, tuple(shape), tuple(h))
        for n, (f, s, e, d, shape, h) in raw["tensors"].items()
    }
    weight_files = {
        n: WeightFile(n, int(size), header.encode("latin-1"))
        for n, (size, header) in raw["weight_files"].items()
    }
    small_files = {n: SmallFile(n, int(s), h) for n, (s, h) in raw["small_files"].items()}
    partial = Manifest(int(raw["chunk_bytes"]), tensors, weight_files, small_files, "", name)
    manifest = Manifest(
        partial.chunk_bytes, tensors, weight_files, small_files, _digest(_content(partial)), name
    )
    _check_names(manifest)
    return manifest


def _check_names(m: Manifest) -> None:
    """Every file a manifest names is a plain name (no folder, no '..'): a manifest from the
    wire can never make a node write outside its cache directory."""
    for name in [*m.weight_files, *m.small_files]:
        if not _plain_name(name):
            raise ManifestError(f"manifest names a file outside the model directory: {name!r}")
    for t in m.tensors.values():
        if t.file not in m.weight_files:
            raise ManifestError(f"tensor {t.name!r} is in unlisted file {t.file!r}")
        size = m.weight_files[t.file].size
        if not (len(m.weight_files[t.file].header) <= t.start <= t.end <= size):
            raise ManifestError(f"tensor {t.name!r} lies outside its file {t.file!r}")
        if len(t.chunk_hashes) != chunk_count(t.nbytes, m.chunk_bytes):
            raise ManifestError(f"tensor {t.name!r} has the wrong number of chunk hashes")


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return max(1, -(-nbytes // chunk_bytes))


# ---- building one from a directory ----


def read_safetensors_header(path: Path) -> tuple[bytes, dict]:
    """(raw header bytes including the 8-byte length, parsed JSON) of a safetensors file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ManifestError(f"{path} is too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > SAFETENSORS_HEADER_MAX:
            raise ManifestError(f"{path}: safetensors header of {length} bytes")
        header = f.read(length)
    if len(header) != length:
        raise ManifestError(f"{path}: safetensors header cut short")
    try:
        return prefix + header, json.loads(header)
    except ValueError as error:
        raise ManifestError(f"{path}: unreadable safetensors header: {error}") from None


def _weight_file_names(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as error:
            raise ManifestError(f"{index}: {error}") from None
    if (model_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ManifestError(f"{model_dir} has no model.safetensors(.index.json)")


def _small_file_names(model_dir: Path) -> list[str]:
    return sorted(
        p.name
        for p in model_dir.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix in SMALL_FILE_SUFFIXES
        and p.stat().st_size <= SMALL_FILE_MAX_BYTES
    )


def _hash_range(path: Path, offset: int, length: int) -> str:
    """`content_digest` of a byte range."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise ManifestError(f"{path} is shorter than its header says")
    return content_digest(data)


def build_manifest(model_dir: Path, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
    """Hash a model directory (one read of every tensor, in parallel threads)."""
    model_dir = Path(model_dir)
    weight_files: dict[str, WeightFile] = {}
    layout: list[tuple[str, str, int, int, str, tuple[int, ...]]] = []
    for name in _weight_file_names(model_dir):
        path = model_dir / name
        if not path.is_file():
            raise ManifestError(f"{path} is listed in the index but missing")
        raw, header = read_safetensors_header(path)
        size = path.stat().st_size
        weight_files[name] = WeightFile(name, size, raw)
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            start, stop = len(raw) + begin, len(raw) + end
            if not (len(raw) <= start <= stop <= size):
                raise ManifestError(f"{path}: tensor {tensor!r} lies outside the file")
            layout.append((tensor, name, start, stop, info["dtype"], tuple(info["shape"])))
    jobs = [
        (t, i, model_dir / f, *_range(start, stop, i, chunk_bytes))
        for t, f, start, stop, _, _ in layout
        for i in range(chunk_count(stop - start, chunk_bytes))
    ]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        hashes = list(pool.map(lambda job: _hash_range(job[2], job[3], job[4]), jobs))
    per_tensor: dict[str, list[str]] = {}
    for (tensor, _, _, _, _), digest in zip(jobs, hashes, strict=True):
        per_tensor.setdefault(tensor, []).append(digest)
    tensors = {
        t: TensorEntry(t, f, start, stop, dtype, shape, tuple(per_tensor[t]))
        for t, f, start, stop, dtype, shape in layout
    }
    small_files = {
        n: SmallFile(
            n, (model_dir / n).stat().st_size, content_digest((model_dir / n).read_bytes())
        )
        for n in _small_file_names(model_dir)
    }
    partial = Manifest(chunk_bytes, tensors, weight_files, small_files, "")
    return Manifest(
        chunk_bytes,
        tensors,
        weight_files,
        small_files,
        _digest(_content(partial)),
        model_dir.resolve().name,
    )


def _range(start: int, stop: int, index: int, chunk_bytes: int) -> tuple[int, int]:
    offset = start + index * chunk_bytes
    return offset, min(chunk_bytes, stop - offset)


# ---- the cache beside the directory ----


def _snapshot(model_dir: Path) -> dict[str, list[int]]:
    """Size and mtime of every file the manifest covers (a change means: hash again)."""
    names = [*_weight_file_names(model_dir), *_small_file_names(model_dir)]
    out = {}
    for name in names:
        try:
            st = (model_dir / name).stat()
        except FileNotFoundError:
            raise ManifestError(f"{model_dir / name} is listed in the index but missing") from None
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _cache_paths(model_dir: Path) -> Iterator[Path]:
    yield model_dir / CACHE_NAME
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:24]
    yield Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cluster" / key


def manifest_for(model_dir: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
    """The directory's manifest: from its cache while no file changed, else hashed anew and
    cached (beside the directory, or in the user's cache if the directory is read-only)."""
    model_dir = Path(model_dir)
    snapshot = _snapshot(model_dir)
    for path in _cache_paths(model_dir):
        try:
            cached = json.loads(path.read_bytes())
            if cached["snapshot"] == snapshot and cached["chunk_bytes"] == chunk_bytes:
                manifest = Manifest.from_json(cached["manifest"].encode())
                return dataclasses.replace(manifest, name=model_dir.resolve().name)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    manifest = build_manifest(model_dir, chunk_bytes)
    if _snapshot(model_dir) != snapshot:
        raise ManifestError(f"{model_dir} changed while it was being hashed; try again")
    record = json.dumps(
        {"snapshot": snapshot, "chunk_bytes": chunk_bytes, "manifest": manifest.to_json().decode()}
    )
    for path in _cache_paths(model_dir):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_text(record)
            os.replace(tmp, path)
            break
        except OSError as error:
            log.debug("cannot cache the manifest at %s: %s", path, error)
    return manifest


def snapshot_of(model_dir: Path) -> dict[str, list[int]]:
    """Public form of the change detector, for the service (size, mtime_ns per file)."""
    return _snapshot(model_dir)
