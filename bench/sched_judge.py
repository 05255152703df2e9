"""sched_compare's judgments: lvf against vllm at each (trace, profile, rate), over seeds.

Each rate runs on several seeds of arrivals (the same seeds for both policies). A :class:`Run`
holds the mean of its seeds' rows (what the tables print and the judgments read) and the rows
themselves; a :class:`Pair` holds lvf's and vllm's, and the intervals of its gains and ratios:
percentile-bootstrap 95 % over the seeds, paired by seed (``lab/stats.py``). Judgment (b)'s gain
passes only when its interval's low end clears the threshold; (a)'s ratios are judged on the
value over all seeds, their intervals printed beside. See bench/sched_compare.py's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lab.sim.sweep import SweepJob
from lab.stats import Interval, mean_interval, ratio_interval

H200, GH200 = "h200-llama3-8b", "gh200-llama3-8b"
PROFILES = (H200, GH200)
CONTENDED = 0.5  # vllm TTFT attainment below this: a contended rate
MIN_RATIO = 0.95  # (a)
GAIN_PTS = {GH200: 40.0, H200: 20.0}  # (b)
MAX_TBT_LOSS_PTS = 5.0
MIN_CONTENDED_TPUT = 0.98
AMPLE_HBM_GIB = 128.0  # the reference run at each (b) point: vllm where memory does not bind
MIN_GAP_PTS = 20.0  # a memory gap this large gets a gap_share_* RESULT field


class Judged(Protocol):
    """A trace as the judgments see it."""

    @property
    def name(self) -> str: ...

    @property
    def required(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Run:
    """One variant at one rate: ``row`` is the mean over ``seed_rows`` (one seed: its row)."""

    workload: str
    profile: str
    factor: float  # rate / knee (0 for ablation runs)
    job: SweepJob
    row: dict[str, Any]
    details: dict[str, Any]
    seed_rows: tuple[dict[str, Any], ...] = ()

    @property
    def rows(self) -> tuple[dict[str, Any], ...]:
        return self.seed_rows or (self.row,)


def mean_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Key by key: the mean of numbers (ints stay ints, rounded; None values skipped, None when
    all are), the first row's value otherwise."""
    out: dict[str, Any] = {}
    for key, first in rows[0].items():
        values = [r.get(key) for r in rows]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if not numbers or len(numbers) + values.count(None) < len(values):
            out[key] = first
        elif all(isinstance(v, int) for v in numbers):
            out[key] = round(sum(numbers) / len(numbers))
        else:
            out[key] = sum(numbers) / len(numbers)
    return out


def merge_seeds(runs: Sequence[Run]) -> list[Run]:
    """One run per (trace, profile, variant, rate), in first-seen order, over its seeds."""
    groups: dict[tuple[str, str, str, float], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.profile, r.job.name, r.job.rps), []).append(r)
    return [
        Run(
            g[0].workload,
            g[0].profile,
            g[0].factor,
            g[0].job,
            mean_row([r.row for r in g]),
            mean_row([r.details for r in g]),
            tuple(r.row for r in g),
        )
        for g in groups.values()
    ]


def _ratio(a: float, b: float) -> float:
    """a / b; 1.0 when both are 0 (equal), inf when only b is."""
    if b > 0:
        return a / b
    return 1.0 if a <= 0 else math.inf


@dataclass(frozen=True, slots=True)
class Pair:
    """lvf against vllm at one (trace, profile, rate)."""

    workload: str
    profile: str
    factor: float
    rps: float
    vllm: dict[str, Any]
    lvf: dict[str, Any]
    vllm_seeds: tuple[dict[str, Any], ...] = ()  # per seed, paired with lvf_seeds
    lvf_seeds: tuple[dict[str, Any], ...] = ()

    def seed_rows(self) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
        """(vllm's rows, lvf's rows), one per seed, paired."""
        if self.vllm_seeds:
            return self.vllm_seeds, self.lvf_seeds
        return (self.vllm,), (self.lvf,)

    def gain_interval(self) -> Interval:
        """lvf - vllm TTFT attainment (points): the mean over seeds and its interval."""
        vllm, lvf = self.seed_rows()
        gains = [
            100 * (b["ttft_attainment"] - a["ttft_attainment"])
            for a, b in zip(vllm, lvf, strict=True)
        ]
        return mean_interval(gains)

    def ratio_interval(self, key: str) -> Interval:
        """lvf / vllm of ``key`` (a ratio of sums over seeds) and its interval."""
        vllm, lvf = self.seed_rows()
        return ratio_interval([b[key] for b in lvf], [a[key] for a in vllm])

    @property
    def goodput_ratio(self) -> float:
        return _ratio(self.lvf["goodput_rps"], self.vllm["goodput_rps"])

    @property
    def tput_ratio(self) -> float:
        return _ratio(self.lvf["output_tokens_per_s"], self.vllm["output_tokens_per_s"])

    @property
    def ttft_gain_pts(self) -> float:
        return 100 * (self.lvf["ttft_attainment"] - self.vllm["ttft_attainment"])

    @property
    def tbt_delta_pts(self) -> float:
        return 100 * (self.lvf["tbt_attainment"] - self.vllm["tbt_attainment"])

    @property
    def contended(self) -> bool:
        return bool(self.vllm["ttft_attainment"] < CONTENDED)

    @property
    def side_ok(self) -> bool:
        """(b)'s side conditions: TBT at most 5 points lower, tokens/s >= 0.98x."""
        return self.tbt_delta_pts >= -MAX_TBT_LOSS_PTS and self.tput_ratio >= MIN_CONTENDED_TPUT

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.workload,
            "profile": self.profile,
            "factor": self.factor,
            "rps": self.rps,
            "vllm_ttft": self.vllm["ttft_attainment"],
            "goodput_ratio": finite(self.goodput_ratio),
            "tput_ratio": finite(self.tput_ratio),
            "ttft_gain_pts": self.ttft_gain_pts,
            "tbt_delta_pts": self.tbt_delta_pts,
            "contended": self.contended,
        }


def make_pairs(runs: Sequence[Run]) -> list[Pair]:
    """lvf against vllm wherever both ran (``runs`` merged over seeds, seeds in equal order)."""
    by = {(r.workload, r.profile, r.job.rps, r.job.name): r for r in runs}
    return [
        Pair(r.workload, r.profile, r.factor, r.job.rps, r.row, lvf.row, r.rows, lvf.rows)
        for r in runs
        if r.job.name == "vllm"
        and (lvf := by.get((r.workload, r.profile, r.job.rps, "lvf"))) is not None
    ]


# --- judgments -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Judgment:
    kind: str  # "a": ratios at every rate; "b": the contended gain
    workload: str
    profile: str
    passed: bool
    required: bool
    text: str
    point: Pair | None = None  # (b): the contended rate judged
    ample_ttft: float | None = None  # (b): vllm's TTFT attainment there with ample HBM (mean)
    ample_seeds: tuple[float, ...] = ()  # (b): the same per seed, paired with the point's

    def key(self) -> str:
        """``<trace>_<gpu>`` as RESULT keys name it (``azure_code_h200``)."""
        return f"{self.workload}_{self.profile.split('-')[0]}".replace("-", "_")

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        note = "" if self.required else " (for information)"
        return f"{verdict} ({self.kind}) {self.workload} on {self.profile}{note}: {self.text}"

    @property
    def memory_gap_pts(self) -> float:
        """(b): vllm's TTFT attainment with ample HBM less its attainment at this HBM: what
        memory costs vllm at this point (nan without the reference run)."""
        if self.point is None or self.ample_ttft is None:
            return math.nan
        return 100 * (self.ample_ttft - self.point.vllm["ttft_attainment"])

    def gap_share(self) -> Interval | None:
        """(b): lvf's TTFT gain / the memory gap (both summed over seeds), with its interval;
        None without the reference runs."""
        p = self.point
        if p is None or self.ample_ttft is None:
            return None
        vllm, lvf = p.seed_rows()
        ample = self.ample_seeds or (self.ample_ttft,) * len(vllm)
        gains = [
            b["ttft_attainment"] - a["ttft_attainment"] for a, b in zip(vllm, lvf, strict=True)
        ]
        gaps = [m - a["ttft_attainment"] for m, a in zip(ample, vllm, strict=True)]
        return ratio_interval(gains, gaps)

    def reference_line(self) -> str:
        """(b)'s gain beside what memory costs vllm at the same point."""
        p, share = self.point, self.gap_share()
        if p is None or self.ample_ttft is None or share is None:
            return ""
        return (
            f"  reference {self.workload} on {self.profile} at {p.rps:g} req/s: vllm with "
            f"{AMPLE_HBM_GIB:g} GiB HBM {pct(self.ample_ttft).strip()} % TTFT: memory costs "
            f"vllm {self.memory_gap_pts:.1f} pts here, lvf wins back {p.ttft_gain_pts:+.1f} "
            f"({_share_pct(share.value)} % [{_share_pct(share.lo)}, {_share_pct(share.hi)}])"
        )


def judge_ratios(cell: Sequence[Pair], required: bool = True) -> Judgment:
    """(a): lvf's goodput and tokens/s >= 0.95x vllm's at every rate of one trace and profile."""
    worst_g = min(cell, key=lambda p: p.goodput_ratio)
    worst_t = min(cell, key=lambda p: p.tput_ratio)
    passed = worst_g.goodput_ratio >= MIN_RATIO and worst_t.tput_ratio >= MIN_RATIO
    g, t = worst_g.ratio_interval("goodput_rps"), worst_t.ratio_interval("output_tokens_per_s")
    text = (
        f"worst goodput ratio {worst_g.goodput_ratio:.3f} [{g.lo:.3f}, {g.hi:.3f}] at "
        f"{worst_g.rps:g} req/s, worst tok/s ratio {worst_t.tput_ratio:.3f} [{t.lo:.3f}, "
        f"{t.hi:.3f}] at {worst_t.rps:g} req/s (need >= {MIN_RATIO:g} over all seeds)"
    )
    return Judgment("a", cell[0].workload, cell[0].profile, passed, required, text)


def best_contended(cell: Sequence[Pair]) -> Pair | None:
    """The contended rate meeting (b)'s side conditions with the largest TTFT gain, else the
    contended rate with the largest gain; None when vllm is >= 50 % at every rate."""
    hot = [p for p in cell if p.contended]
    return max(hot, key=lambda p: (p.side_ok, p.ttft_gain_pts), default=None)


def judge_contended(cell: Sequence[Pair], required: bool) -> Judgment:
    """(b) on one trace and profile (see the module docstring)."""
    workload, profile = cell[0].workload, cell[0].profile
    p = best_contended(cell)
    if p is None:
        text = "no contended rate (vllm TTFT attainment >= 50 % at every rate)"
        return Judgment("b", workload, profile, False, required, text)
    need = GAIN_PTS[profile]
    gain = p.gain_interval()
    passed = gain.above(need) and p.side_ok
    text = (
        f"at {p.rps:g} req/s vllm TTFT {pct(p.vllm['ttft_attainment']).strip()} % -> lvf "
        f"{pct(p.lvf['ttft_attainment']).strip()} % ({p.ttft_gain_pts:+.1f} pts "
        f"[{gain.lo:+.1f}, {gain.hi:+.1f}], need >= +{need:g} over the interval), "
        f"TBT {p.tbt_delta_pts:+.1f} pts (need >= -{MAX_TBT_LOSS_PTS:g}), "
        f"tok/s {p.tput_ratio:.3f}x (need >= {MIN_CONTENDED_TPUT:g})"
    )
    return Judgment("b", workload, profile, passed, required, text, p)


def judge(pairs: Sequence[Pair], workloads: Sequence[Judged]) -> list[Judgment]:
    out = []
    for w in workloads:
        for profile in PROFILES:
            cell = sorted(
                (p for p in pairs if p.workload == w.name and p.profile == profile),
                key=lambda p: p.rps,
            )
            if cell:
                out += [judge_ratios(cell), judge_contended(cell, w.required)]
    return out


def summarize(pairs: Sequence[Pair], judgments: Sequence[Judgment]) -> dict[str, float]:
    """The RESULT line's figures (nan where nothing was judged)."""
    b = [j for j in judgments if j.kind == "b"]
    gated = [j for j in b if j.required] or b

    def gain(profile: str) -> Interval:
        points = [j.point for j in gated if j.profile == profile]
        if not points or any(p is None for p in points):
            return Interval(math.nan, math.nan, math.nan)
        worst = min((p for p in points if p is not None), key=lambda p: p.ttft_gain_pts)
        return worst.gain_interval()

    points = [j.point for j in gated if j.point is not None]
    out = {
        "worst_goodput_ratio": min((p.goodput_ratio for p in pairs), default=math.nan),
        "worst_tput_ratio": min((p.tput_ratio for p in pairs), default=math.nan),
        "gh200_gain_pts": gain(GH200).value,
        "h200_gain_pts": gain(H200).value,
        "tbt_delta_pts": min((p.tbt_delta_pts for p in points), default=math.nan),
        "gh200_memory_gap_pts": _gap(gated, GH200),
        "h200_memory_gap_pts": _gap(gated, H200),
    }
    for profile in PROFILES:
        iv = gain(profile)
        out |= {
            f"{profile.split('-')[0]}_gain_pts_lo": iv.lo,
            f"{profile.split('-')[0]}_gain_pts_hi": iv.hi,
        }
    for j in b:
        share = j.gap_share()
        if share is not None and j.memory_gap_pts >= MIN_GAP_PTS:
            out |= share.fields(f"gap_share_{j.key()}")
    return out


def _gap(gated: Sequence[Judgment], profile: str) -> float:
    """The memory gap at the (b) point whose gain is the profile's headline (the smallest)."""
    judged = [j for j in gated if j.profile == profile and j.point is not None]
    if not judged:
        return math.nan
    return min(judged, key=lambda j: j.point.ttft_gain_pts if j.point else math.inf).memory_gap_pts


def fields_text(fields: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in fields.items())


def result_line(summary: dict[str, float]) -> str:
    extra = {
        k: v
        for k, v in summary.items()
        if k.startswith(("capacity_", "gap_share_")) or k.endswith(("_lo", "_hi"))
    }
    return f"{_headline(summary)} {fields_text(extra)}".rstrip()


def _headline(summary: dict[str, float]) -> str:
    return (
        f"RESULT sched_compare worst_goodput_ratio={summary['worst_goodput_ratio']:.3f}"
        f" worst_tput_ratio={summary['worst_tput_ratio']:.3f}"
        f" gh200_gain_pts={summary['gh200_gain_pts']:.1f}"
        f" h200_gain_pts={summary['h200_gain_pts']:.1f}"
        f" tbt_delta_pts={summary['tbt_delta_pts']:.1f}"
        f" gh200_memory_gap_pts={summary.get('gh200_memory_gap_pts', math.nan):.1f}"
        f" h200_memory_gap_pts={summary.get('h200_memory_gap_pts', math.nan):.1f}"
    )


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def _share_pct(x: float) -> str:
    return f"{100 * x:.0f}" if math.isfinite(x) else "nan"
