"""The streaming HF loader: sharded checkpoints (with and without an index) match transformers,
a missing, duplicated, misshapen or unknown weight is a ModelConfigError naming it, a bf16
checkpoint stays bf16 in the storage allocated once, and tied embeddings stay tied."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine, generate
from data_plane.engine.sampling import SamplingParams, SamplingRow
from data_plane.models import ModelConfigError, load_model
from data_plane.models import loader as loader_module
from data_plane.models.llama import DecoderLayer, LlamaModel
from tests.data_plane.hf_models import build_hf_model, hf_greedy

INDEX = "model.safetensors.index.json"
PROMPTS = [[5, 9, 17, 33, 4], [100, 7, 250, 3, 3, 8, 61, 12, 19]]
NUM_NEW = 6


def _single_file(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1 and not (directory / INDEX).exists()
    return files[0]


def _sharded(family: str, directory: Path) -> Any:
    """A checkpoint saved by transformers in several shards with an index."""
    model: Any = build_hf_model(family, directory)
    for file in directory.glob("*.safetensors"):
        file.unlink()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    assert len(list(directory.glob("*.safetensors"))) > 2 and (directory / INDEX).exists()
    return model


def _engine_greedy(directory: Path) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens of each prompt, and the logits of its first output, from our engine."""
    engine = build_engine(load_model(str(directory)), EngineConfig(num_hbm_blocks=1024))
    runner = engine.executor.runner  # type: ignore[attr-defined]
    inner, first = runner.sampler, {}

    class Recording:
        def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
            for index, row in enumerate(rows):
                if row.output_index == 0:
                    first[row.params.seed or 0] = logits[index].clone()
            return inner.sample(logits, rows)

    runner.sampler = Recording()
    params = [
        SamplingParams(max_tokens=NUM_NEW, temperature=0, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    results = generate(engine, PROMPTS, params)
    return [(result.token_ids, first[i]) for i, result in enumerate(results)]


@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_sharded_checkpoint_matches_transformers(
    tmp_path: Path, family: str, with_index: bool
) -> None:
    hf = _sharded(family, tmp_path)
    if not with_index:
        (tmp_path / INDEX).unlink()  # the shards' headers are scanned instead
    for (tokens, logits), prompt in zip(_engine_greedy(tmp_path), PROMPTS, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, NUM_NEW)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_fused_parameters_hold_the_checkpoint_rows_exactly(tmp_path: Path) -> None:
    hf_state = build_hf_model("qwen2", tmp_path).state_dict()
    model = load_model(str(tmp_path)).model
    attn = "model.layers.2.self_attn."
    for kind in ("weight", "bias"):
        qkv = torch.cat([hf_state[f"{attn}{p}_proj.{kind}"] for p in "qkv"])
        assert torch.equal(getattr(cast(DecoderLayer, model.layers[2]).qkv_proj, kind), qkv)
    mlp = "model.layers.1.mlp."
    gate_up = torch.cat([hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]])
    assert torch.equal(cast(DecoderLayer, model.layers[1]).gate_up_proj.weight, gate_up)


@pytest.mark.parametrize("with_index", [True, False])
def test_a_missing_weight_is_named(tmp_path: Path, with_index: bool) -> None:
    key = "model.layers.1.mlp.up_proj.weight"
    if with_index:
        _sharded("llama3", tmp_path)
        index = json.loads((tmp_path / INDEX).read_text())
        del index["weight_map"][key]
        (tmp_path / INDEX).write_text(json.dumps(index))
    else:
        build_hf_model("llama3", tmp_path)
        file = _single_file(tmp_path)
        state = load_file(str(file))
        del state[key]
        save_file(state, str(file))
    with pytest.raises(ModelConfigError, match=re.escape(f"'{key}' is missing")):
        load_model(str(tmp_path))


def _edit_single_file(directory: Path, **extra: torch.Tensor) -> None:
    file = _single_file(directory)
    state = load_file(str(file))
    save_file({**state, **{k.replace("__", "."): v for k, v in extra.items()}}, str(file))


def test_harmless_extras_are_ignored_and_unknown_weights_are_errors(tmp_path: Path) -> None:
    build_hf_model("qwen2", tmp_path)  # tied: a saved lm_head.weight is harmless too
    inv_freq = torch.ones(4)
    _edit_single_file(
        tmp_path,
        model__layers__0__self_attn__rotary_emb__inv_freq=inv_freq,
        lm_head__weight=torch.zeros(320, 64),
    )
    model = load_model(str(tmp_path)).model
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.abs().sum() > 0
    _edit_single_file(tmp_path, model__layers__0__self_attn__o_proj__bias=torch.zeros(64))
    with pytest.raises(
        ModelConfigError, match=re.escape("does not use: 'model.layers.0.self_attn.o_proj")
    ):
        load_model(str(tmp_path))


def test_a_misshapen_or_duplicated_weight_is_named(tmp_path: Path) -> None:
    _sharded("mistral", tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    key = "model.layers.0.mlp.down_proj.weight"
    file = tmp_path / index["weight_map"][key]
    state = load_file(str(file))
    save_file({**state, key: state[key][:, :-1].contiguous()}, str(file))
    with pytest.raises(ModelConfigError, match=re.escape(f"'{key}' has shape")):
        load_model(str(tmp_path))
    save_file(state, str(file))
    (tmp_path / INDEX).unlink()
    save_file({key: state[key]}, str(tmp_path / "zz-extra.safetensors"))
    with pytest.raises(ModelConfigError, match=re.escape(f"'{key}' is in the checkpoint twice")):
        load_model(str(tmp_path))


def test_bf16_checkpoint_loads_into_the_storage_allocated_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf: Any = build_hf_model("llama3", tmp_path).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    built: list[dict[str, int]] = []
    empty_model = loader_module.empty_model

    def recording_empty_model(config, device="cpu") -> LlamaModel:
        model = empty_model(config, device)
        built.append({name: p.data_ptr() for name, p in model.named_parameters()})
        return model

    monkeypatch.setattr(loader_module, "empty_model", recording_empty_model)
    model = load_model(str(tmp_path), dtype="bfloat16").model
    assert len(built) == 1  # one allocation, filled in place: load_model's final .to is a no-op
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == built[0]
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    assert torch.equal(model.embed_tokens.weight, hf.state_dict()["model.embed_tokens.weight"])


def test_fp32_checkpoint_is_cast_on_the_way(tmp_path: Path) -> None:
    hf_state = build_hf_model("mistral", tmp_path).state_dict()
    model = load_model(str(tmp_path), dtype="float16").model
    assert all(p.dtype == torch.float16 for p in model.parameters())
    expected = hf_state["model.layers.2.self_attn.o_proj.weight"].to(torch.float16)
    assert torch.equal(cast(DecoderLayer, model.layers[2]).o_proj.weight, expected)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    _sharded("qwen2", tmp_path)
    model = load_model(str(tmp_path), dtype="bfloat16").model
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert len(list(model.parameters())) == len({p.data_ptr() for p in model.parameters()})


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    _sharded("llama3", tmp_path)
    name = json.loads((tmp_path / INDEX).read_text())["weight_map"]["model.norm.weight"]
    (tmp_path / name).unlink()
    with pytest.raises(ModelConfigError, match=re.escape(f"shard '{name}'")):
        load_model(str(tmp_path))


def test_copies_in_small_chunks_give_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_hf_model("qwen2", tmp_path)
    whole = load_model(str(tmp_path)).model.state_dict()
    monkeypatch.setattr(loader_module, "COPY_CHUNK_BYTES", 1000)  # a few rows per chunk
    chunked = load_model(str(tmp_path)).model.state_dict()
    assert all(torch.equal(tensor, chunked[name]) for name, tensor in whole.items())
