"""Peak host memory of loading a checkpoint: the streaming loader vs the old load-everything one.

Builds a random bf16 Llama checkpoint (vocab 32000, hidden 1024, 12 layers: ~380 MiB of
weights in 200 MiB safetensors shards with an index) in a temp dir, or takes ``--model DIR``.
Each loader runs in a fresh subprocess, so that its peak is its own: the child imports
everything, notes its RSS, resets the kernel's high-water mark (``/proc/self/clear_refs``),
loads, and reports the peak: ``VmHWM``, and ``ru_maxrss`` beside it, which also holds the
imports' peak and, as exec keeps it, the parent's (so the checkpoint is built in a child too).
A first-use cost of the load counts: modules it imports, code pages it touches. The loaders,
both asked for bfloat16 on the CPU:

- ``streaming``: ``load_model(dir, dtype="bfloat16")``: the model is built without init in
  bf16 and each tensor is copied from its shard into its parameter in chunks of <= 16 MiB;
- ``old``: the loader before it, reproduced here: ``load_file`` of every shard into one dict,
  ``LlamaModel(config)`` in fp32 with random init, copy, then ``.to(bfloat16)``.

The shards are in the page cache for both (the bench just wrote or first reads them), and the
mapped pages of a shard count in RSS while they are mapped. Prints a table, then the ratios of
each peak RSS increase to the checkpoint's size on disk (target: streaming <= 1.3x), as the last
line: ``RESULT load_memory peak_ratio=... old_peak_ratio=... checkpoint_mib=...``.

    .venv/bin/python bench/load_memory.py [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_plane.models.config import ModelConfig  # noqa: E402
from data_plane.models.llama import DecoderLayer, LlamaModel  # noqa: E402

MIB = 1024 * 1024
LOADERS = ("streaming", "old")
FULL = dict(vocab=32000, hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=4)
QUICK = dict(vocab=4096, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default=None, help="a checkpoint directory (default: build a random one)")
    add("--quick", action="store_true", help="a ~10 MiB checkpoint (smoke test)")
    add("--shard-mib", type=float, default=200.0, help="shard size of the built checkpoint")
    add("--child", choices=(*LOADERS, "build"), default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def checkpoint_tensors(size: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in the order transformers writes them."""
    h, i, d = size["hidden"], size["intermediate"], size["hidden"] // size["heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (size["vocab"], h))]
    for n in range(size["layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        shapes += [(f"{p}self_attn.{x}_proj.weight", (h, h)) for x in "qo"]
        shapes += [(f"{p}self_attn.{x}_proj.weight", (size["kv_heads"] * d, h)) for x in "kv"]
        shapes += [(f"{p}mlp.{x}_proj.weight", (i, h)) for x in ("gate", "up")]
        shapes.append((p + "mlp.down_proj.weight", (h, i)))
    return [*shapes, ("model.norm.weight", (h,)), ("lm_head.weight", (size["vocab"], h))]


def build_checkpoint(directory: Path, size: dict[str, int], shard_mib: float) -> None:
    """Random bf16 weights in shards of about ``shard_mib`` with an index, and a config."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, shape in checkpoint_tensors(size):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shards[-1] and _nbytes(shards[-1]) + tensor.nbytes > shard_mib * MIB:
            shards.append({})
        shards[-1][name] = tensor
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(_nbytes(shard) for shard in shards)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(_hf_config(size), indent=2))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def _hf_config(size: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size["vocab"],
        "hidden_size": size["hidden"],
        "intermediate_size": size["intermediate"],
        "num_hidden_layers": size["layers"],
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def old_load(directory: Path) -> LlamaModel:
    """The loader before streaming: every shard in one dict, an fp32 model with random init,
    the weights copied in, then the cast that ``load_model`` did at the end."""
    from safetensors.torch import load_file

    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    config = ModelConfig(**{**_fields(config), "dtype": torch.bfloat16})
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    model = LlamaModel(config)
    _old_copy(model, state, config)
    model.to(dtype=config.dtype)
    return model


def _fields(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in ModelConfig.__dataclass_fields__}


def _old_copy(model: LlamaModel, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    with torch.no_grad():
        model.embed_tokens.weight.copy_(state.pop("model.embed_tokens.weight"))
        model.norm.weight.copy_(state.pop("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(state.pop("lm_head.weight"))
        for index, module in enumerate(model.layers):
            layer, p = cast(DecoderLayer, module), f"model.layers.{index}."
            qkv = [state.pop(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
            layer.qkv_proj.weight.copy_(torch.cat(qkv))
            layer.o_proj.weight.copy_(state.pop(p + "self_attn.o_proj.weight"))
            gate_up = [state.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
            layer.gate_up_proj.weight.copy_(torch.cat(gate_up))
            layer.down_proj.weight.copy_(state.pop(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(state.pop(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                state.pop(p + "post_attention_layernorm.weight")
            )


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def run_child(loader: str, directory: Path) -> dict[str, float]:
    """Load once and return the RSS figures (MiB); runs inside the subprocess."""
    import gc
    import resource

    from data_plane.models import load_model

    gc.collect()
    before = _status_kib()["VmRSS"]
    with contextlib.suppress(OSError):  # reset VmHWM to the current RSS: the load's own peak
        Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    if loader == "streaming":
        model = load_model(str(directory), dtype="bfloat16").model
    else:
        model = old_load(directory)
    seconds = time.perf_counter() - start
    after = _status_kib()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    dtypes = {str(p.dtype) for p in model.parameters()}
    if dtypes != {"torch.bfloat16"}:
        raise RuntimeError(f"the {loader} loader gave parameters of {sorted(dtypes)}")
    peak = after.get("VmHWM", maxrss)
    return {
        "seconds": seconds,
        "before_mib": before / 1024,
        "peak_mib": peak / 1024,
        "increase_mib": (peak - before) / 1024,
        "maxrss_increase_mib": (maxrss - before) / 1024,
        "after_mib": after["VmRSS"] / 1024,
    }


def in_child(child: str, directory: Path, *extra: str) -> str:
    """Run this script as ``--child CHILD`` in a fresh interpreter; its last stdout line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", child]
    command += ["--model", str(directory), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"--child {child} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def report(rows: dict[str, dict[str, float]], checkpoint_mib: float) -> str:
    print(f"checkpoint: {checkpoint_mib:.1f} MiB of safetensors on disk")
    head = ("loader", "load s", "RSS before", "peak RSS", "increase", "x ckpt", "ru_maxrss inc")
    print("{:<10} {:>7} {:>11} {:>9} {:>9} {:>7} {:>14}".format(*head))
    for loader, row in rows.items():
        print(
            f"{loader:<10} {row['seconds']:7.2f} {row['before_mib']:10.1f}M"
            f" {row['peak_mib']:8.1f}M {row['increase_mib']:8.1f}M"
            f" {row['increase_mib'] / checkpoint_mib:6.2f}x {row['maxrss_increase_mib']:13.1f}M"
        )
    ratio = rows["streaming"]["increase_mib"] / checkpoint_mib
    old_ratio = rows["old"]["increase_mib"] / checkpoint_mib
    verdict = "PASS" if ratio <= 1.3 else "FAIL"
    print(f"{verdict}: streaming peak increase {ratio:.2f}x the checkpoint (target <= 1.3x)")
    return (
        f"RESULT load_memory peak_ratio={ratio:.3f} old_peak_ratio={old_ratio:.3f}"
        f" checkpoint_mib={checkpoint_mib:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "build":
        build_checkpoint(Path(args.model), QUICK if args.quick else FULL, args.shard_mib)
        print("built")
    elif args.child is not None:
        print(json.dumps(run_child(args.child, Path(args.model))))
    else:
        run_bench(args)
    return 0


def run_bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        directory = Path(args.model) if args.model else Path(tmp)
        if args.model is None:  # in a child too, to keep this process's peak RSS low
            quick = ["--quick"] if args.quick else []
            in_child("build", directory, "--shard-mib", str(args.shard_mib), *quick)
        files = sorted(directory.glob("*.safetensors"))
        checkpoint_mib = sum(f.stat().st_size for f in files) / MIB
        print(f"{directory}: {len(files)} shard(s)")
        rows = {loader: json.loads(in_child(loader, directory)) for loader in LOADERS}
        print(report(rows, checkpoint_mib))


if __name__ == "__main__":
    sys.exit(main())
