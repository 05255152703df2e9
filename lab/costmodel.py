"""Iteration-time cost model: what one engine step and one KV transfer cost on a given GPU.

Used by the simulator that runs the real engine in virtual time. The model is a sum of terms
(not a roofline max), so it errs on the slow side when weight reads and compute overlap::

    iteration = fixed_overhead
              + weight_bytes / hbm_bandwidth                      (weights read once per step)
              + prefill_tokens * prefill_s_per_token              (GEMMs of prompt tokens)
              + attention_pairs * attention_s_per_pair            (prefill attention scores)
              + context_tokens * kv_bytes_per_token / hbm_bandwidth  (KV read by attention)

``context_tokens`` is the sum over scheduled sequences of the tokens each one attends to.
``attention_pairs`` counts the (query, key) pairs of the prefill chunks: a chunk of ``c`` tokens
starting at offset ``s`` has ``c * s + c * (c + 1) / 2`` (:func:`prefill_attention_pairs`).
Decode tokens' GEMM FLOPs and attention are not counted beyond the KV read: a decode step is
bound by the weight read. A profile without ``prefill_s_per_token`` (older files) charges
``flops_per_token / peak_flops`` per prefill token, and ``attention_s_per_pair`` defaults to 0.

Two more costs the simulator charges with a profile's constants:

- copy/compute interference: KV copies running under an iteration's compute slow it down;
  the iteration takes ``compute + (1 / copy_compute_overlap_efficiency - 1) * min(compute,
  copy seconds overlapping it)`` (:func:`copy_interference_s`; efficiency 1.0: no interference);
- planning: each engine step first pays ``plan_fixed_s + plan_per_request_s * requests`` in
  the snapshot (:func:`plan_time_s`), the policy's planning time on the worker's CPU.

Profiles are JSON files; the built-in ones live in ``lab/profiles/<name>.json``. Every
constant's origin is kept under ``"_sources"`` (``CostProfile.sources``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from shared.b_xfer import b_xfer_blocks_at_rate

_PROFILE_PACKAGE = "lab"
_PROFILE_DIR = "profiles"
_SOURCES_KEY = "_sources"
_COUNT_NAMES = (
    "num_prefill_tokens",
    "num_decode_seqs",
    "num_context_tokens",
    "num_attention_pairs",
)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Constants of one (GPU, model) pair. Bytes, seconds, FLOPs; rates per second."""

    name: str
    source: str
    fixed_overhead_s: float
    weight_bytes: float
    hbm_bandwidth_bytes_s: float
    flops_per_token: float
    peak_flops: float
    kv_bytes_per_token: float
    link_h2d_bytes_s: float
    link_d2h_bytes_s: float
    duplex: bool
    link_duplex_bytes_s: float
    block_size_tokens: int = 16
    hbm_kv_bytes_total: float | None = None
    prefill_s_per_token: float | None = None  # None: flops_per_token / peak_flops
    attention_s_per_pair: float = 0.0
    copy_compute_overlap_efficiency: float = 1.0
    plan_fixed_s: float = 0.0
    plan_per_request_s: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        positive = (
            "weight_bytes",
            "hbm_bandwidth_bytes_s",
            "flops_per_token",
            "peak_flops",
            "kv_bytes_per_token",
            "link_h2d_bytes_s",
            "link_d2h_bytes_s",
            "link_duplex_bytes_s",
            "block_size_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"profile {self.name!r}: {name} must be > 0, got {value!r}")
        if not self.fixed_overhead_s >= 0:
            raise ValueError(f"profile {self.name!r}: fixed_overhead_s must be >= 0")
        if self.hbm_kv_bytes_total is not None and not self.hbm_kv_bytes_total > 0:
            raise ValueError(f"profile {self.name!r}: hbm_kv_bytes_total must be > 0 or null")
        if not isinstance(self.duplex, bool):
            raise ValueError(f"profile {self.name!r}: duplex must be true or false")
        self._check_new_fields()

    def _check_new_fields(self) -> None:
        per_token = self.prefill_s_per_token
        if per_token is not None and not (math.isfinite(per_token) and per_token > 0):
            raise ValueError(f"profile {self.name!r}: prefill_s_per_token must be > 0 or null")
        for name in ("attention_s_per_pair", "plan_fixed_s", "plan_per_request_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"profile {self.name!r}: {name} must be >= 0, got {value!r}")
        efficiency = self.copy_compute_overlap_efficiency
        if not (isinstance(efficiency, int | float) and 0 < efficiency <= 1):
            raise ValueError(
                f"profile {self.name!r}: copy_compute_overlap_efficiency must be in (0, 1],"
                f" got {efficiency!r}"
            )


def kv_block_bytes(profile: CostProfile) -> int:
    """Bytes of one KV block (all layers, K and V) of ``profile``'s model."""
    return int(profile.kv_bytes_per_token * profile.block_size_tokens)


def prefill_attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of a causal prefill chunk of ``num_tokens`` tokens after ``start``
    tokens of KV: token ``i`` of the chunk attends to ``start + i + 1`` keys."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def iteration_time_s(
    profile: CostProfile,
    num_prefill_tokens: int,
    num_decode_seqs: int,
    num_context_tokens: int,
    num_attention_pairs: int = 0,
) -> float:
    """Seconds one engine step takes (module docstring formula); 0.0 for an empty step.

    ``num_attention_pairs``: the prefill chunks' (query, key) pairs, summed
    (:func:`prefill_attention_pairs` of each chunk)."""
    counts = (num_prefill_tokens, num_decode_seqs, num_context_tokens, num_attention_pairs)
    if min(counts) < 0:
        name, value = next((n, v) for n, v in zip(_COUNT_NAMES, counts, strict=True) if v < 0)
        raise ValueError(f"{name} must be >= 0, got {value}")
    if num_prefill_tokens == 0 and num_decode_seqs == 0:
        return 0.0
    hbm = profile.hbm_bandwidth_bytes_s
    per_token = profile.prefill_s_per_token
    if per_token is None:
        per_token = profile.flops_per_token / profile.peak_flops
    return (
        profile.fixed_overhead_s
        + profile.weight_bytes / hbm
        + num_prefill_tokens * per_token
        + num_attention_pairs * profile.attention_s_per_pair
        + num_context_tokens * profile.kv_bytes_per_token / hbm
    )


def copy_interference_s(profile: CostProfile, compute_s: float, copy_s: float) -> float:
    """Seconds KV copies add to ``compute_s`` of model execution when ``copy_s`` seconds of
    them run under it: ``(1 / copy_compute_overlap_efficiency - 1) * min(compute_s, copy_s)``.
    With efficiency ``e``, a copy as long as the compute makes both take ``compute / e``
    (ANCHORS.md: max(copy, gemm) / both together = 0.90)."""
    if compute_s < 0 or copy_s < 0:
        raise ValueError(f"times must be >= 0, got compute={compute_s}, copy={copy_s}")
    return (1.0 / profile.copy_compute_overlap_efficiency - 1.0) * min(compute_s, copy_s)


def plan_time_s(profile: CostProfile, num_requests: int) -> float:
    """Seconds the policy takes to plan one step over a snapshot of ``num_requests``
    requests: ``plan_fixed_s + plan_per_request_s * num_requests``."""
    return profile.plan_fixed_s + profile.plan_per_request_s * num_requests


def transfer_time_s(profile: CostProfile, bytes_h2d: float, bytes_d2h: float) -> float:
    """Seconds to move ``bytes_h2d`` in and ``bytes_d2h`` out, both issued at once.

    Duplex link: each direction at its one-direction rate, but together no faster than the
    measured aggregate ``link_duplex_bytes_s``. Otherwise the directions take turns.
    """
    if bytes_h2d < 0 or bytes_d2h < 0:
        raise ValueError(f"bytes must be >= 0, got h2d={bytes_h2d}, d2h={bytes_d2h}")
    h2d_s = bytes_h2d / profile.link_h2d_bytes_s
    d2h_s = bytes_d2h / profile.link_d2h_bytes_s
    if not profile.duplex:
        return h2d_s + d2h_s
    return max(h2d_s, d2h_s, (bytes_h2d + bytes_d2h) / profile.link_duplex_bytes_s)


def exposed_transfer_s(compute_s: float, transfer_s: float) -> float:
    """Transfer time not hidden under ``compute_s`` of model execution running alongside."""
    if compute_s < 0 or transfer_s < 0:
        raise ValueError(f"times must be >= 0, got compute={compute_s}, transfer={transfer_s}")
    return max(0.0, transfer_s - compute_s)


def auto_b_xfer_blocks(profile: CostProfile, predicted_iteration_s: float, block_bytes: int) -> int:
    """B_xfer: blocks one link direction moves in one predicted iteration (floor, at least 1).

    Uses the slower of the two one-direction rates.
    """
    rate = min(profile.link_h2d_bytes_s, profile.link_d2h_bytes_s)
    return b_xfer_blocks_at_rate(rate, predicted_iteration_s, block_bytes)


def with_link_scale(profile: CostProfile, factor: float) -> CostProfile:
    """``profile`` with its host link ``factor`` times faster each way and duplex (a what-if:
    ``superinfer simulate --link-scale``, bench/sched_compare.py's free-link ceiling)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"link scale must be a finite number > 0, got {factor!r}")
    if factor == 1.0:
        return profile
    return replace(
        profile,
        name=f"{profile.name} (link x{factor:g})",
        link_h2d_bytes_s=profile.link_h2d_bytes_s * factor,
        link_d2h_bytes_s=profile.link_d2h_bytes_s * factor,
        link_duplex_bytes_s=profile.link_duplex_bytes_s * factor,
    )


def builtin_profile_names() -> list[str]:
    """Names of the profiles shipped in ``lab/profiles``."""
    folder = resources.files(_PROFILE_PACKAGE).joinpath(_PROFILE_DIR)
    if not folder.is_dir():
        return []
    return sorted(
        p.name.removesuffix(".json")
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(".json")
    )


def load_profile(name_or_path: str | Path) -> CostProfile:
    """A built-in profile by name, else the JSON profile at that path."""
    text = str(name_or_path)
    if text in builtin_profile_names():
        resource = resources.files(_PROFILE_PACKAGE).joinpath(_PROFILE_DIR, f"{text}.json")
        return profile_from_dict(json.loads(resource.read_text(encoding="utf-8")))
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown cost profile {text!r}: not a built-in"
            f" ({', '.join(builtin_profile_names()) or 'none'}) and no such file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost profile {path} is not valid JSON: {exc}") from None
    return profile_from_dict(data)


def profile_from_dict(data: Mapping[str, Any]) -> CostProfile:
    """Inverse of ``profile_to_dict``; keys starting with ``_`` other than ``_sources`` are
    comments and ignored; unknown or missing fields raise ValueError."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a cost profile must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(CostProfile)} - {"sources"}
    values = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown cost profile fields {unknown}; known: {sorted(names)}")
    required = {
        f.name for f in fields(CostProfile) if f.default is MISSING and f.default_factory is MISSING
    }
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"cost profile {data.get('name')!r} lacks fields {missing}")
    sources = data.get(_SOURCES_KEY, {})
    if not isinstance(sources, Mapping):
        raise ValueError(f"{_SOURCES_KEY} must be an object of field -> origin")
    return CostProfile(**values, sources=dict(sources))


def profile_to_dict(profile: CostProfile) -> dict[str, Any]:
    """Plain JSON-able dict of ``profile``; origins go under ``"_sources"``."""
    out: dict[str, Any] = {
        f.name: getattr(profile, f.name) for f in fields(CostProfile) if f.name != "sources"
    }
    out[_SOURCES_KEY] = dict(profile.sources)
    return out


def save_profile(profile: CostProfile, path: str | Path) -> None:
    """Write ``profile`` as JSON to ``path`` (e.g. one fitted on a GPU)."""
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n", encoding="utf-8")
