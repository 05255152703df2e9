"""lab/crossing.py's crossing search on scripted metrics with known crossings, and SLO
capacity from real simulations (a policy's capacity falls when its pool shrinks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lab import crossing
from lab.costmodel import load_profile
from lab.sim import capacity as cap
from lab.sim.setup import SimSetup
from lab.sim.sweep import SweepJob
from shared.policy import Knobs

TOL = 1.1


def _search(
    search: crossing.CrossingSearch, metric: Callable[[float], float]
) -> crossing.CrossingSearch:
    while (rate := search.next_rate()) is not None:
        search.probes.append((rate, metric(rate)))
    return search


def _falling(crossing: float, threshold: float = 0.5) -> Callable[[float], float]:
    """A monotone metric equal to ``threshold`` at ``crossing``, linear around it."""
    slope = (1.0 - threshold) / crossing
    return lambda rps: min(1.0, max(0.0, 1.0 - slope * rps))


@pytest.mark.parametrize("start", [0.3, 6.0, 7.0, 100.0])
@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_search_brackets_then_bisects(start: float, threshold: float) -> None:
    search = _search(crossing.CrossingSearch(start, threshold, TOL), _falling(7.0, threshold))
    lo, hi = search.bracket()
    assert lo is not None and hi is not None
    assert lo[0] <= 7.0 <= hi[0] and hi[0] / lo[0] <= TOL + 1e-9
    assert search.crossing() == pytest.approx(7.0, rel=1e-6)  # linear inside the bracket
    assert search.capacity() == search.crossing()
    assert len(search.probes) <= crossing.MAX_PROBES


def test_search_from_a_table_value_takes_two_probes_when_it_holds() -> None:
    search = _search(crossing.CrossingSearch(7.2, 0.5, TOL, TOL), _falling(7.0))
    assert len(search.probes) == 2
    table = crossing.CrossingSearch(7.2, 0.5, TOL, fixed=7.2)
    assert table.next_rate() is None and table.crossing() == 7.2 == table.capacity()


def test_search_gives_up_without_a_crossing() -> None:
    never = _search(crossing.CrossingSearch(1.0, 0.5, TOL), lambda rps: 1.0)
    assert len(never.probes) <= crossing.MAX_PROBES
    assert never.crossing() == max(r for r, _ in never.probes) == crossing.MAX_SEARCH_RPS
    always = _search(crossing.CrossingSearch(1.0, 0.5, TOL), lambda rps: 0.0)
    assert (
        len(always.probes) <= crossing.MAX_PROBES and always.crossing() <= crossing.MIN_SEARCH_RPS
    )
    assert always.capacity() == 0.0  # nothing meets the target: no capacity at all


def test_bad_search_settings_are_refused() -> None:
    for args in ((0.0, 0.5), (1.0, 0.5, 1.0), (1.0, 0.5, 1.1, 0.9)):
        with pytest.raises(ValueError):
            crossing.CrossingSearch(*args)


def _job(hbm_kv_gib: float, seed: int) -> Callable[[str, float], SweepJob]:
    setup = SimSetup(load_profile("h200-llama3-8b"), hbm_kv_gib, 0.0)
    return lambda policy, rps: SweepJob(
        "synthetic:2048:256", rps, 20.0, policy, Knobs(), setup, seed=seed, horizon_s=80.0
    )


def test_capacity_of_real_simulations_falls_with_memory() -> None:
    """vllm on a fixed-length trace: a quarter of the KV pool cannot hold the batch its rate
    needs, so its SLO capacity is lower (both searches run in lock step)."""
    searches = {
        (gib, seed): crossing.CrossingSearch(4.0, crossing.CAPACITY_TARGET, 1.25)
        for gib in (1.0, 4.0)
        for seed in (0, 1)
    }
    seen: list[float] = []

    def job(key: tuple[float, int], rate: float) -> SweepJob:
        return _job(key[0], key[1])("vllm", rate)

    cap.run_searches(searches, job, cap.CAPACITY_METRIC, on_probe=lambda k, r, row: seen.append(r))
    assert len(seen) == sum(len(s.probes) for s in searches.values())
    for seed in (0, 1):
        small, large = searches[(1.0, seed)], searches[(4.0, seed)]
        assert None not in small.bracket() and None not in large.bracket()
        assert 0 < small.capacity() < large.capacity()


def test_simulate_capacity_cli(tmp_path, capsys) -> None:
    from lab.sim.cli import main

    out = tmp_path / "cap.json"
    argv = ["--trace", "synthetic:512:64", "--duration", "5", "--horizon", "30"]
    argv += ["--hbm-kv-gib", "0.25", "--dram-kv-gib", "2", "--policies", "vllm,lvf"]
    argv += ["--capacity", "--seeds", "2", "--hawkes", "0.3", "--json", str(out)]
    assert main([*argv, "--rps", "2"]) == 0
    data = __import__("json").loads(out.read_text())
    assert data["config"]["hawkes"] == 0.3 and data["config"]["seeds"] == 2
    vllm, lvf = data["capacity"]["vllm"], data["capacity"]["lvf"]
    assert len(vllm["capacity_rps"]) == 2 and vllm["ratio"] == 1.0
    assert lvf["ratio"] == pytest.approx(sum(lvf["capacity_rps"]) / sum(vllm["capacity_rps"]))
    assert {p["seed"] for p in data["probes"]} == {0, 1}
    assert "SLO capacity (>= 90 % of requests meet TTFT and TPOT)" in capsys.readouterr().out
    for bad in (
        ["--rps", "2,3"],
        ["--rps", "2", "--seeds", "0"],
        ["--rps", "2", "--plot", "x.png"],
    ):
        assert main([*argv, *bad]) == 2
    assert main([*argv[:-7], "--capacity-target", "0.8", "--json", str(out), "--rps", "2"]) == 2
