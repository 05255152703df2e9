"""Worker settings (env prefix ``SUPERINFER_``), built in ``main()`` and passed down."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.model_source import default_model

CPU_LONG_PREFILL_TOKENS = 512  # long_prefill_token_threshold's default on the CPU


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPERINFER_")

    worker_id: str = "worker-0"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # local dir, .gguf, llama2.c .bin, hub id (org/name), tiny-random; default: SmolLM2's GGUF
    model: str = Field(default_factory=default_model)
    revision: str | None = None  # of a hub id
    # the model's name in this worker's vLLM metrics (vllm:*{model_name}) and status: the
    # gateway's served_model_name (None: the model's own name, as the gateway's default)
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    # vLLM's --quantization: auto keeps a GGUF file's quantized layers quantized on the CPU
    # (dequantized elsewhere); gguf insists on it; none dequantizes every weight to --dtype.
    quantization: str | None = None
    device: str = "cpu"
    # CPU threads for the model's kernels (llama.cpp's -t); None: every core this process may
    # run on (data_plane/threads.py).
    threads: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1, le=4096)
    # None: sized by gpu_memory_utilization (engine/sizing.py)
    hbm_kv_gib: float | None = Field(default=None, gt=0.0)
    # vLLM's; None: 0.9 on CUDA, 1 GiB KV on CPU
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    max_model_len: int | None = Field(default=None, ge=1)  # vLLM's; must fit the pool
    dram_kv_gib: float = Field(default=0.0, ge=0.0)
    # vLLM's name for the host tier in GiB (= dram_kv_gib)
    swap_space: float | None = Field(default=None, ge=0.0)
    tensor_parallel_size: int = 1  # only 1 is served (one worker per GPU)
    num_hbm_blocks: int | None = Field(default=None, ge=1)
    num_dram_blocks: int | None = Field(default=None, ge=0)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # vLLM's --long-prefill-token-threshold: the most tokens one prefill chunk takes (0: up to
    # the whole budget); a long prompt then leaves room for the prompts behind it. None: 512
    # on the CPU (a short request behind a 2,000-token prompt 0.58x the wait, the prompt 1.04x:
    # bench/long_prefill.py), 0 elsewhere (vLLM's default; a GPU step is short).
    long_prefill_token_threshold: int | None = Field(default=None, ge=0)

    def resolved_long_prefill_token_threshold(self) -> int:
        """The cap in force: the setting, or its device's default."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return CPU_LONG_PREFILL_TOKENS if self.device == "cpu" else 0

    max_num_seqs: int = Field(default=256, ge=1)
    # auto: cuda on a CUDA device with cuda-python, else cpu
    transfer_backend: Literal["auto", "cpu", "cuda", "naive"] = "auto"
    # vLLM's --enable-prefix-caching (on by default, as in vLLM V1): shared prompt prefixes
    # are computed once; with a DRAM tier its synced copies are a second level.
    enable_prefix_caching: bool = True
    dram_prefix_caching: bool = True
    # The knobs' policy and B_xfer where Redis has no knobs yet (written there before the first
    # step); the worker plans with the knobs in Redis, whoever wrote them. B_xfer None (or
    # "auto"): the measured link bandwidth x the iteration time.
    policy: str = "lvf"
    b_xfer: int | None = Field(
        default=None, ge=1, le=2**31 - 1, json_schema_extra={"flag_words": ["auto"]}
    )
    # older remote plans are ignored; the worker plans locally
    plan_max_age_iterations: int = Field(default=4, ge=0)
    # Snapshots as deltas against the table of the newest fresh plan (the rows changed since:
    # shared/protocol/delta.py); off: every snapshot carries its whole table.
    snapshot_deltas: bool = True
    read_batch: int = Field(default=256, ge=1)  # requests taken from the stream per iteration
    idle_block_ms: int = Field(default=50, ge=1)  # 0 would block the idle read forever
    # status for gateways (routing, readiness, metrics)
    heartbeat_interval_s: float = Field(default=0.5, gt=0.0)
    # An engine step running this long, and 10x the longest before it, is stalled: the
    # heartbeat stops (gateways end its streams and route elsewhere) until it ends
    step_stall_s: float = Field(default=30.0, gt=0.0)
    # A gateway whose heartbeat (superinfer:gateways) has not changed for this long, as this
    # worker watched it, is dead: its requests here are aborted, each ending with an error on
    # its output stream (read if that gateway was only frozen).
    gateway_dead_s: float = Field(default=10.0, gt=0)
    # heartbeats older than this leave the hash, with their gateway's output stream
    gateway_forget_s: float = Field(default=3600.0, gt=0.0)
    # /health, /ready, /metrics on this port; None or 0: off
    health_port: int | None = Field(default=None, ge=0, le=65535)
    health_host: str = "0.0.0.0"
    # on SIGTERM: finish the requests it owns for up to this long
    drain_timeout_s: float = Field(default=30.0, ge=0.0)
    # A stopped worker's request and plan streams expire this long after it stopped unless a
    # worker of the same id starts again (with random pod names each roll left a pair)
    stopped_streams_ttl_s: float = Field(default=3600.0, gt=0.0)
    # every Redis call (longer than any blocking read's block time)
    redis_timeout_s: float = Field(default=5.0, gt=0.0)

    @field_validator("tensor_parallel_size")
    @classmethod
    def _one_device(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"--tensor-parallel-size {value}: a worker serves one device; run one worker "
                "per GPU instead (docs/deployment.md)"
            )
        return value

    @model_validator(mode="after")
    def _cuda_copies_need_cuda(self) -> WorkerSettings:
        if self.transfer_backend == "cuda" and not self.device.startswith("cuda"):
            raise ValueError(
                f"transfer_backend cuda copies between a GPU's KV pool and host memory; "
                f"device is {self.device!r} (auto picks the backend for the device)"
            )
        return self

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from shared.policy import POLICY_NAMES

        if value not in POLICY_NAMES:
            raise ValueError(f"{value!r} is not one of {', '.join(POLICY_NAMES)}")
        return value

    @model_validator(mode="after")
    def _one_host_tier_size(self) -> WorkerSettings:
        """``swap_space`` (vLLM's name) and ``dram_kv_gib`` size the same tier: one, or equal."""
        if self.swap_space is not None and self.dram_kv_gib not in (0.0, self.swap_space):
            raise ValueError(
                f"swap_space {self.swap_space} and dram_kv_gib {self.dram_kv_gib} both size "
                "the host KV tier; give one"
            )
        return self

    @model_validator(mode="after")
    def _forget_after_dead(self) -> WorkerSettings:
        """A gateway is forgotten (its output stream deleted) only after it could be dead."""
        if self.gateway_forget_s < self.gateway_dead_s:
            raise ValueError(
                f"gateway_forget_s {self.gateway_forget_s:g} must be >= gateway_dead_s "
                f"{self.gateway_dead_s:g}"
            )
        return self

    @field_validator("b_xfer", mode="before")
    @classmethod
    def _auto_b_xfer(cls, value: Any) -> Any:
        """``auto`` (or empty) is None: B_xfer measured on the link."""
        return None if isinstance(value, str) and value.strip().lower() in ("auto", "") else value


def missing_device_problem(device: str) -> str | None:
    """Why this machine cannot serve on ``device`` (a CUDA device it lacks), else None: checked
    at start, before the weights load (a missing GPU failed with a traceback after them).
    Not a settings validator: a deployment's settings are valid whatever machine reads them.
    torch is imported only to check a CUDA device."""
    if not device.startswith("cuda"):
        return None
    import torch

    try:
        index = torch.device(device).index
    except RuntimeError as exc:
        return f"--device {device!r} is not a device torch knows: {exc}"
    if not torch.cuda.is_available():
        return f"--device {device!r}: this torch ({torch.__version__}) sees no CUDA device"
    if index is not None and index >= torch.cuda.device_count():
        return f"--device {device!r}: this machine has {torch.cuda.device_count()} GPUs"
    return None
