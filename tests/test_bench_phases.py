"""`turboattn bench phases` reads the decode kernel's per-CTA stamps (csrc/decode.cuh, a profiling build): its
arithmetic on synthetic stamps, since the stamps themselves need a GPU."""

import pytest
import torch

from turboattn.cli.bench import phases


def _stamps(ctas: int, ghz: float) -> torch.Tensor:
    """CTA i starts at global time 1000 + 10 i ns and runs phases of known lengths (µs) at `ghz` cycles per ns;
    CTA 2 is the merging one."""
    us = {phases.STAGED: 1.0, phases.TABLES: 0.5, phases.READY: 0.25, phases.LOOP_DONE: 10.0,
          phases.WARPS_DONE: 0.5, phases.PART_DONE: 2.0}
    s = torch.zeros(ctas, phases.SLOTS, dtype=torch.int64)
    for i in range(ctas):
        clock = 5000 + 1000 * i          # each SM's clock has its own origin
        s[i, phases.G_START] = 1000 + 10 * i
        s[i, phases.START] = clock
        t = 0.0
        for slot in (phases.STAGED, phases.TABLES, phases.READY, phases.LOOP_DONE, phases.WARPS_DONE,
                     phases.PART_DONE):
            t += us[slot]
            s[i, slot] = clock + round(t * 1e3 * ghz)
        s[i, phases.G_PART] = 1000 + 10 * i + round(t * 1e3)
        if i == 2:
            for slot, dt in ((phases.MERGE, 1.5), (phases.MERGE_WEIGHTS, 2.0), (phases.MERGE_SUMMED, 1.0)):
                t += dt
                s[i, slot] = clock + round(t * 1e3 * ghz)
            t += 0.5
        s[i, phases.END] = clock + round(t * 1e3 * ghz)
        s[i, phases.G_END] = 1000 + 10 * i + round(t * 1e3)
        s[i, phases.SM] = i % 3
    return s


def test_phases_are_read_at_the_clock_the_global_timer_gives():
    r = phases.summarize(_stamps(7, ghz=1.75))
    assert r["ctas"] == 7 and r["ctas_per_sm"] == {"min": 2, "max": 3}
    assert r["sm_clock_ghz"] == pytest.approx(1.75, rel=1e-3)
    for key, want in (("staged_us", 1.0), ("tables_us", 0.5), ("q_us", 0.25), ("loop_us", 10.0),
                      ("warps_us", 0.5), ("combine_us", 2.0), ("arrive_us", 1.5), ("merge_weights_us", 2.0),
                      ("merge_sum_us", 1.0), ("merge_out_us", 0.5), ("merge_us", 3.5)):
        assert r[key] == pytest.approx(want, abs=2e-3), key
    assert r["start_spread_us"] == pytest.approx(0.06)
    assert r["parts_last_us"] == pytest.approx(0.06 + 14.25)
    assert r["end_us"] == pytest.approx(0.02 + 14.25 + 5.0)   # the merging CTA ends last


def test_exact_rows_ctas_are_timed_apart_from_the_splits():
    """The grid's last CTAs attend the exact rows and stamp their own phases (in the split slots): the splits' medians
    leave them out (more exact CTAs than splits here, so with them every median would move), and their own
    median time to their part and the last one's part are reported."""
    s = _stamps(7, ghz=1.75)
    n = 8
    exact = torch.zeros(n, phases.SLOTS, dtype=torch.int64)
    for k in range(n):
        clock = 90000 + 1000 * k
        t = 3.0 + 0.5 * k
        exact[k, phases.G_START] = 1000 + 5 * k
        exact[k, phases.START] = clock
        # Its own phases in the split slots: set-up 0.5, first scores 1.0, the other rows t - 2.0, output 0.5 µs.
        for slot, at in ((phases.STAGED, 0.5), (phases.TABLES, 1.5), (phases.READY, t - 0.5)):
            exact[k, slot] = clock + round(at * 1e3 * 1.75)
        exact[k, phases.PART_DONE] = clock + round(t * 1e3 * 1.75)
        exact[k, phases.G_PART] = 1000 + 5 * k + round(t * 1e3)
        exact[k, phases.END] = exact[k, phases.PART_DONE] + round(0.1 * 1e3 * 1.75)
        exact[k, phases.G_END] = exact[k, phases.G_PART] + 100
        exact[k, phases.SM] = k % 3
    r = phases.summarize(torch.cat([s, exact]), exact_ctas=n)
    alone = phases.summarize(s)
    for key in ("staged_us", "tables_us", "q_us", "loop_us", "loop_max_us", "warps_us", "combine_us",
                "parts_median_us"):
        assert r[key] == pytest.approx(alone[key], abs=2e-3), key   # the clock rate: over all CTAs, rounded stamps
    assert r["exact_ctas"] == n and r["exact_us"] == pytest.approx(3.0 + 0.5 * 3.5, abs=2e-3)
    assert r["exact_last_us"] == pytest.approx(0.035 + 6.5)
    for key, want in (("exact_setup_us", 0.5), ("exact_scores_us", 1.0), ("exact_rows_us", 1.0 + 0.5 * 3.5),
                      ("exact_out_us", 0.5)):
        assert r[key] == pytest.approx(want, abs=2e-3), key
    assert alone["exact_ctas"] == 0 and alone["exact_us"] == 0.0 and alone["exact_last_us"] == 0.0
