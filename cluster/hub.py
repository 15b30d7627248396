"""Where a `--model` lives: a directory on this machine, or a Hugging Face repo id.

`resolve_model("mlx-community/Qwen3.5-27B-4bit")` returns the snapshot directory of that repo in
the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`), downloading what is missing unless
`HF_HUB_OFFLINE` is set, in which case only the cache is read. `org/name@REVISION` pins a
branch, tag or commit. An existing directory always wins over a repo id of the same spelling,
so `./models/foo` never reaches the network.

Only the coordinator (and the single-process commands) resolve a model: the nodes receive
their shard's tensors from the coordinator, never from the hub.
"""

from __future__ import annotations

import re
from pathlib import Path

from cluster.config import ModelDirError

# Hugging Face's rule for a repo id: an optional owner, a name; letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")
# What a checkpoint needs to be served; the weights are the safetensors beside them.
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py", "*.tiktoken"]


def looks_like_repo_id(text: str) -> bool:
    """Whether `text` (less any `@revision`) is spelled like `owner/name` and is not a path."""
    name = text.split("@", 1)[0]
    return (
        "/" in name
        and not name.startswith((".", "/", "~"))
        and not name.endswith("/")
        and bool(_REPO_ID.match(name))
    )


def resolve_model(model: str | Path) -> Path:
    """The local directory of `model`: the path itself when it exists, else the hub snapshot
    of the repo id it names. Raises ModelDirError naming what was tried when neither holds."""
    path = Path(model).expanduser()
    if path.exists() or not looks_like_repo_id(str(model)):
        if not path.is_dir():
            raise ModelDirError(f"{model} is not a model directory (nor an owner/name repo id)")
        return path
    repo_id, _, revision = str(model).partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as error:  # pragma: no cover - a dependency of mlx-lm
        raise ModelDirError(f"{model} looks like a repo id, but huggingface_hub: {error}") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=_PATTERNS))
    except LocalEntryNotFoundError:
        raise ModelDirError(
            f"{repo_id}{'@' + revision if revision else ''} is not in the Hugging Face cache and "
            "cannot be downloaded (HF_HUB_OFFLINE is set, or the hub is unreachable): download "
            "it on a connected machine or pass a directory"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ModelDirError(f"cannot fetch {model} from the Hugging Face hub: {error}") from None


def resolve_mtp_source(model: str | Path) -> Path:
    """The local directory of `model` for the MTP head alone (`cluster convert --mtp-from`): a
    directory as it is; for a repo id, its config, tokenizer files and index, and of its
    weights only the files that hold `mtp.*` tensors, so that grafting the head of a large
    release does not fetch the whole release."""
    path = Path(model).expanduser()
    if path.exists() or not looks_like_repo_id(str(model)):
        return resolve_model(model)
    import json

    repo_id, _, revision = str(model).partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    def fetch(patterns: list[str]) -> Path:
        try:
            return Path(
                snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns)
            )
        except LocalEntryNotFoundError:
            raise ModelDirError(
                f"{model} is not in the Hugging Face cache and cannot be downloaded "
                "(HF_HUB_OFFLINE is set, or the hub is unreachable)"
            ) from None
        except (HfHubHTTPError, OSError, ValueError) as error:
            raise ModelDirError(f"cannot fetch {model} from the hub: {error}") from None

    metadata = [p for p in _PATTERNS if p != "*.safetensors"]
    snapshot = fetch(metadata)
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():  # one file holds everything
        return fetch([*metadata, "model.safetensors"])
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted({f for key, f in weight_map.items() if key.startswith("mtp.")})
    return fetch([*metadata, *files]) if files else snapshot
