"""``benchmarks/gossip_step.py``'s row filter (the full run is a benchmark, not a test)."""

from benchmarks.gossip_step import BASE, selected


def test_only_keeps_the_matching_rows_and_the_all_reduce_row():
    rows = [BASE, "D-Adam ring overlap", "D-Adam ring overlap, robust clip", "D-Adam ring"]
    assert [r for r in rows if selected(r, ())] == rows
    assert [r for r in rows if selected(r, ("robust",))] == [BASE, rows[2]]
    assert [r for r in rows if selected(r, ("ring overlap",))] == rows[:3]
    assert [r for r in rows if selected(r, ("nothing", "D-Adam ring"))] == rows
    assert [r for r in rows if selected(r, ("nothing",))] == [BASE]
