"""sled-bench capacity's search over device counts: up the given counts while a mode meets the target, then
bisection between each mode's last count met and its first missed."""

import pytest

from bench.capacity import CountSearch, build_parser

TARGET = {"p95_tpot_ms": 50.0}


def search(caps: dict[str, int], counts, refine: float, bound: str = "slo") -> tuple[list[dict], list]:
    """Run a search where a mode meets the target up to its count in `caps`; returns its capacity and the runs."""
    s, runs = CountSearch(counts, caps, refine), []
    while (step := s.next()) is not None:
        n, modes = step
        for mode in modes:
            runs.append((n, mode))
            row = {"devices": n, "system_tokens_per_s": 10.0 * n}
            s.record(mode, n, row, None if n <= caps[mode] else bound)
    return s.capacity(TARGET), runs


def test_bisection_to_the_device_finds_each_modes_largest_count():
    caps, runs = search({"sled": 21, "server-only": 13}, [1, 2, 4, 8, 16, 32, 64], refine=0.0)
    assert [(c["mode"], c["devices"], c["bound"]) for c in caps] == [("sled", 21, "slo"), ("server-only", 13, "slo")]
    assert caps[0]["system_tokens_per_s"] == 210.0 and caps[0]["slo"] == TARGET
    # the counts rise for a mode only to its first miss, and no count is run twice for a mode
    assert max(n for n, m in runs if m == "server-only") == 16 and max(n for n, m in runs if m == "sled") == 32
    assert len(runs) == len(set(runs))
    assert (64, "sled") not in runs


def test_a_coarser_refine_stops_within_its_share_of_the_count_met():
    caps, runs = search({"sled": 21, "server-only": 13}, [1, 2, 4, 8, 16, 32, 64], refine=0.25)
    sled, base = (c["devices"] for c in caps)
    assert 21 / 1.25 <= sled <= 21 and 13 / 1.25 <= base <= 13
    assert len(runs) < len(search({"sled": 21, "server-only": 13}, [1, 2, 4, 8, 16, 32, 64], refine=0.0)[1])


def test_given_counts_are_sorted_and_a_mode_never_met_is_bisected_from_zero():
    caps, runs = search({"sled": 3, "server-only": 40}, [32, 8], refine=0.0)
    assert [c["devices"] for c in caps] == [3, 32]
    assert [c["bound"] for c in caps] == ["slo", "largest count tried"]
    assert runs[:2] == [(8, "sled"), (8, "server-only")]


def test_a_mode_stopped_by_the_host_is_not_bisected():
    caps, runs = search({"sled": 5, "server-only": 5}, [4, 8], refine=0.0, bound="host")
    assert [(c["devices"], c["bound"]) for c in caps] == [(4, "host"), (4, "host")]
    assert sorted(n for n, _ in runs) == [4, 4, 8, 8]


def test_the_refine_option_refuses_a_negative_share(capsys):
    assert build_parser().parse_args([]).refine == 0.25
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--refine", "-1"])
    assert "must be at least 0" in capsys.readouterr().err
