"""Request traces: real arrival logs and length statistics turned into a list of requests.

``load_trace(spec, ...)`` accepts:

- an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): real arrivals;
- a Mooncake JSONL (``{"timestamp": ms, "input_length", "output_length", ...}``): real arrivals;
- a ShareGPT/Vidur length-stats CSV (``num_prefill_tokens,num_decode_tokens,...``): lengths
  sampled from its rows, arrivals generated at ``rps``;
- ``synthetic`` or ``synthetic:IN:OUT``: fixed lengths (default 512:128), arrivals generated.

The format is detected from the file's first line (JSON object or CSV header), never from its
name. Real arrivals are taken relative to the first; with ``rps`` their gaps are scaled by one
factor so the mean rate equals ``rps`` while the burst shape is kept. Generated arrivals follow
vLLM's ``--burstiness``: gamma gaps with shape ``burstiness`` and scale ``1 / (rps * burstiness)``
(1.0 = Poisson), or with ``hawkes`` > 0 a self-exciting process of that branching ratio
(``lab/arrivals.py``). ``seed`` draws the generated arrivals and lengths; for a real trace it picks
the window: seed 0 its first rows, seed k the k-th next run of as many rows (wrapping).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from lab.arrivals import check_hawkes, hawkes_arrivals

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
STATS_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
DEFAULT_SYNTHETIC_INPUT_LEN = 512
DEFAULT_SYNTHETIC_OUTPUT_LEN = 128
_GENERATE_CHUNK = 4096
_TIMESTAMP_RE = re.compile(
    r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$"
)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrival time in seconds from the trace start, prompt and output lengths."""

    arrival_s: float
    input_len: int
    output_len: int
    # Mooncake's ids of the prompt's 512-token blocks: equal ids, equal tokens (shared
    # prefixes); empty where the trace gives none (every prompt then unique).
    hash_ids: tuple[int, ...] = ()
    # A synthesized conversation (lab/sessions.py): turns of one session share its tokens
    # (the prompt so far is a prefix of the next turn's), all share the system prompt.
    session: int | None = None
    system_len: int = 0
    tenant: str | None = None  # who sends it (per-tenant fairness; bench/fairness.py)
    slo_ttft_s: float | None = None  # its SLO class's (None: the knobs')
    slo_tbt_s: float | None = None


def arrivals(num: int, rps: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``num`` arrival times (seconds, first at 0.0) with gamma gaps of mean ``1 / rps``.

    Shape ``burstiness``, scale ``1 / (rps * burstiness)``: the gaps' coefficient of variation
    is ``1 / sqrt(burstiness)``; 1.0 gives Poisson arrivals (exponential gaps).
    """
    _check_rate(rps, burstiness)
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if num == 0:
        return np.zeros(0, dtype=np.float64)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (rps * burstiness), size=num - 1)
    return np.concatenate(([0.0], np.cumsum(gaps_s)))


def load_trace(
    spec: str,
    *,
    rps: float | None,
    duration_s: float | None,
    num_requests: int | None,
    burstiness: float = 1.0,
    seed: int = 0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    hawkes: float = 0.0,
    hawkes_tau_s: float = 1.0,
) -> list[TraceRequest]:
    """Requests of ``spec`` sorted by arrival, the first at 0.0 (see the module docstring).

    ``duration_s`` keeps arrivals strictly before it, ``num_requests`` keeps the first ones.
    For a real trace with ``rps``, the rate is made exact over the rows kept: the first
    ``num_requests`` rows, or the first ``rps * duration_s + 1`` rows when only a duration is
    given (the last one lands on ``duration_s`` and is cut). ``max_input_len``/``max_output_len``
    clip lengths; every length is at least 1 token.
    """
    _check_limits(rps, duration_s, num_requests, burstiness, max_input_len, max_output_len)
    process = Arrivals(burstiness, hawkes, hawkes_tau_s, seed)
    if spec == "synthetic" or spec.startswith("synthetic:"):
        input_len, output_len = _parse_synthetic(spec)
        pool = np.array([[input_len, output_len]], dtype=np.int64)
        reqs = _generate(pool, rps, duration_s, num_requests, process, spec)
    else:
        path = Path(spec)
        kind = _detect_format(path)
        if kind == "stats":
            pool = _read_stats_lengths(path)
            reqs = _generate(pool, rps, duration_s, num_requests, process, spec)
        else:
            for name, value, default in (("burstiness", burstiness, 1.0), ("hawkes", hawkes, 0.0)):
                if value != default:
                    raise ValueError(
                        f"{name}={value} applies only to generated arrivals; {spec} has"
                        " real arrival times (rescale them with rps instead)"
                    )
            rows = _read_azure(path) if kind == "azure" else _read_mooncake(path)
            reqs = _real_arrivals(rows, rps, duration_s, num_requests, seed)
    return [_clip(r, max_input_len, max_output_len) for r in reqs]


def _check_limits(
    rps: float | None,
    duration_s: float | None,
    num_requests: int | None,
    burstiness: float,
    max_input_len: int | None,
    max_output_len: int | None,
) -> None:
    if rps is not None and not rps > 0:
        raise ValueError(f"rps must be > 0, got {rps}")
    if rps is not None and math.isinf(rps) and duration_s is not None:
        raise ValueError("rps inf sends every request at once: give num_requests, not duration")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    for name, limit in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if limit is not None and limit < 1:
            raise ValueError(f"{name} must be >= 1 (a request keeps at least 1 token), got {limit}")


def _check_rate(rps: float, burstiness: float) -> None:
    if not rps > 0:
        raise ValueError(f"rps must be > 0, got {rps}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")


def _clip(req: TraceRequest, max_input_len: int | None, max_output_len: int | None) -> TraceRequest:
    input_len = req.input_len if max_input_len is None else min(req.input_len, max_input_len)
    output_len = req.output_len if max_output_len is None else min(req.output_len, max_output_len)
    return dataclasses.replace(req, input_len=max(1, input_len), output_len=max(1, output_len))


def _parse_synthetic(spec: str) -> tuple[int, int]:
    if spec == "synthetic":
        return DEFAULT_SYNTHETIC_INPUT_LEN, DEFAULT_SYNTHETIC_OUTPUT_LEN
    parts = spec.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        input_len, output_len = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"bad synthetic spec {spec!r}: expected 'synthetic:IN:OUT'") from None
    if input_len < 1 or output_len < 1:
        raise ValueError(f"bad synthetic spec {spec!r}: lengths must be >= 1")
    return input_len, output_len


def has_real_arrivals(spec: str) -> bool:
    """Whether ``spec`` brings its own arrival times (an Azure or Mooncake trace), which
    ``burstiness`` and ``hawkes`` do not apply to."""
    if spec == "synthetic" or spec.startswith("synthetic:"):
        return False
    return _detect_format(Path(spec)) != "stats"


def _detect_format(path: Path) -> str:
    """'azure', 'mooncake' or 'stats', from the first non-empty line of ``path``."""
    if not path.is_file():
        raise ValueError(f"trace file not found: {path} (or an unknown spec; try 'synthetic')")
    with path.open(encoding="utf-8") as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        try:
            keys = json.loads(first).keys()
        except (json.JSONDecodeError, AttributeError):
            keys = set()
        if all(k in keys for k in MOONCAKE_KEYS):
            return "mooncake"
    else:
        header = [c.strip().lstrip("\ufeff") for c in next(csv.reader([first]), [])]
        if all(c in header for c in AZURE_COLUMNS):
            return "azure"
        if all(c in header for c in STATS_COLUMNS):
            return "stats"
    raise ValueError(
        f"unknown trace format in {path}: expected a CSV with header {','.join(AZURE_COLUMNS)}"
        f" (Azure) or {','.join(STATS_COLUMNS)},... (length stats), or JSONL with keys"
        f" {', '.join(MOONCAKE_KEYS)} (Mooncake); first line: {first[:80]!r}"
    )


def _timestamp_ns(text: str) -> int:
    """Nanoseconds since the epoch of ``2023-11-16 18:17:03.9799600`` (exact, any digit count)."""
    match = _TIMESTAMP_RE.match(text.strip())
    if match is None:
        raise ValueError(f"bad Azure TIMESTAMP {text!r}")
    date, clock, frac, tz = match.groups()
    whole_s = int(datetime.fromisoformat(f"{date}T{clock}+00:00").timestamp())
    frac_ns = int((frac or "0")[:9].ljust(9, "0"))
    offset_s = 0
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        offset_s = sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return (whole_s - offset_s) * 1_000_000_000 + frac_ns


def _read_azure(path: Path) -> list[tuple[float, int, int]]:
    """(seconds from the first arrival, input, output) of every row."""
    rows: list[tuple[int, int, int]] = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        reader.fieldnames = [c.strip().lstrip("\ufeff") for c in reader.fieldnames or []]
        for line_no, row in enumerate(reader, start=2):
            try:
                rows.append(
                    (
                        _timestamp_ns(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad Azure row: {exc}") from None
    return _relative(rows, units_per_s=1e9)


def _read_mooncake(path: Path) -> list[tuple[float, int, int]]:
    """(seconds from the first arrival, input, output, hash ids) of every line; timestamps
    are in ms."""
    rows: list[tuple[float, int, int]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                hash_ids = tuple(int(h) for h in obj.get("hash_ids") or ())
                row = (float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]))
                rows.append((*row, hash_ids))  # type: ignore[arg-type]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad Mooncake line: {exc}") from None
    return _relative(rows, units_per_s=1e3)


def _relative(
    rows: list[tuple[int, int, int]] | list[tuple[float, int, int]], units_per_s: float
) -> list[tuple[float, int, int]]:
    """Sort by time (stable); times become seconds from the first (``units_per_s`` per s)."""
    if not rows:
        return []
    ordered = sorted(rows, key=lambda r: r[0])
    start = ordered[0][0]
    return [((t - start) / units_per_s, *rest) for t, *rest in ordered]  # type: ignore[misc]


def _real_arrivals(
    rows: list[tuple[float, int, int]],
    rps: float | None,
    duration_s: float | None,
    num_requests: int | None,
    seed: int = 0,
) -> list[TraceRequest]:
    num_rows = len(rows)
    if num_requests is not None:
        num_rows = min(num_rows, num_requests)
    if rps is not None and duration_s is not None:
        num_rows = min(num_rows, round(rps * duration_s) + 1)
    start = window_start(len(rows), num_rows, seed)
    rows = rows[start : start + num_rows]
    origin_s = rows[0][0] if rows else 0.0
    scale = 1.0
    span_s = rows[-1][0] - origin_s if rows else 0.0
    if rps is not None and len(rows) > 1 and span_s > 0:
        scale = (len(rows) - 1) / (rps * span_s)
    out = [TraceRequest((row[0] - origin_s) * scale, *row[1:]) for row in rows]
    if duration_s is not None:
        out = [r for r in out if r.arrival_s < duration_s]
    return out


def window_start(num_rows_total: int, num_rows: int, seed: int) -> int:
    """First row of seed ``seed``'s window of ``num_rows``: windows follow one another from the
    trace's start and wrap round to it when the next one would run past the end."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    num_starts = max(1, num_rows_total - num_rows + 1)
    return (seed * num_rows) % num_starts


def _read_stats_lengths(path: Path) -> np.ndarray:
    """(num_rows, 2) array of (prefill, decode) token counts."""
    pairs: list[tuple[int, int]] = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        reader.fieldnames = [c.strip().lstrip("\ufeff") for c in reader.fieldnames or []]
        for line_no, row in enumerate(reader, start=2):
            try:
                pairs.append(
                    (
                        round(float(row["num_prefill_tokens"])),
                        round(float(row["num_decode_tokens"])),
                    )
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad length-stats row: {exc}") from None
    if not pairs:
        raise ValueError(f"{path}: length-stats CSV has no rows")
    return np.array(pairs, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Arrivals:
    """How generated arrivals are drawn: gamma gaps of shape ``burstiness``, or with ``hawkes``
    > 0 a Hawkes process of that branching ratio and kernel mean ``hawkes_tau_s``."""

    burstiness: float = 1.0
    hawkes: float = 0.0
    hawkes_tau_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_hawkes(1.0, self.hawkes, self.hawkes_tau_s)
        if self.hawkes and self.burstiness != 1.0:
            raise ValueError(
                f"hawkes={self.hawkes} and burstiness={self.burstiness}: a Hawkes process's "
                "immigrants are Poisson; choose one of the two"
            )


def _generate(
    pool: np.ndarray,
    rps: float | None,
    duration_s: float | None,
    num_requests: int | None,
    process: Arrivals,
    spec: str,
) -> list[TraceRequest]:
    """Generated arrivals at ``rps``, lengths drawn uniformly (with replacement) from ``pool``."""
    if rps is None:
        raise ValueError(f"{spec}: a length-stats or synthetic trace needs rps (arrivals are made)")
    if duration_s is None and num_requests is None:
        raise ValueError(f"{spec}: a generated trace needs duration_s or num_requests")
    rng = np.random.default_rng(process.seed)
    if process.hawkes:
        times_s = hawkes_arrivals(
            rps, process.hawkes, process.hawkes_tau_s, rng, duration_s, num_requests
        )
    else:
        times_s = _arrivals_until(rps, process.burstiness, rng, duration_s, num_requests)
    picks = rng.integers(0, len(pool), size=len(times_s))
    return [
        TraceRequest(float(t), int(pool[i, 0]), int(pool[i, 1]))
        for t, i in zip(times_s, picks, strict=True)
    ]


def _arrivals_until(
    rps: float,
    burstiness: float,
    rng: np.random.Generator,
    duration_s: float | None,
    num_requests: int | None,
) -> np.ndarray:
    """Arrivals before ``duration_s`` and at most ``num_requests`` of them (one of the two set)."""
    if duration_s is None:
        return arrivals(num_requests or 0, rps, burstiness, rng)
    times_s = np.zeros(1)
    while times_s[-1] < duration_s and (num_requests is None or len(times_s) < num_requests):
        gaps_s = rng.gamma(burstiness, 1.0 / (rps * burstiness), size=_GENERATE_CHUNK)
        times_s = np.concatenate((times_s, times_s[-1] + np.cumsum(gaps_s)))
    times_s = times_s[times_s < duration_s]
    return times_s if num_requests is None else times_s[:num_requests]
