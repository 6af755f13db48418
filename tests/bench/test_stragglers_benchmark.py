"""The straggler benchmark's quick mode on real gloo processes, and its docs table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import stragglers  # noqa: E402
from benchmarks.report_sections import render_stragglers  # noqa: E402


def test_summary_and_table_without_processes():
    def run(rates, mixed, skipped):
        return {"steps_per_s": rates, "averaged_model_train_loss": 0.2,
                "slow_rank_exchanges_mixed": mixed, "slow_rank_exchanges_skipped": skipped,
                "fast_edges_skipped_fraction": 0.5, "distance_to_average": [0.1] * 4}  # fmt: skip

    runs = stragglers.summarise({
        "clean": run([10.0] * 4, 0, 0), "slow": run([2.0] * 4, 8, 0),
        "slow_deadline_5ms": run([9.0, 9.0, 8.5, 2.0], 0, 8),
    })  # fmt: skip
    deadline = runs["slow_deadline_5ms"]
    assert deadline["fast_ranks_drop_max"] == pytest.approx(0.15)
    assert deadline["throughput_met"] and not deadline["slow_rank_counted"]
    assert not deadline["met"] and runs["slow"]["slow_rank_counted"] and "met" not in runs["clean"]
    r = {"slow_rank": 3, "slow_factor": 5.0, "setup": "s", "goal": "g", "date": "2026-12-03",
         "machine": "m", "torch": "t", "command": "c", "results": {"ring": runs}}  # fmt: skip
    table = render_stragglers(r)
    assert "| ring | slow_deadline_5ms | 8.8 | 2.0 | 12% (15%) | 0 / 8 | 50% |" in table


@pytest.mark.slow  # three launches of 4 processes: 20 s on an idle machine, a minute loaded
@pytest.mark.timeout(240)
def test_quick_run_writes_the_measurements(tmp_path):
    out = tmp_path / "stragglers.json"
    stragglers.main(["--quick", "--out", str(out)])
    r = json.loads(out.read_text())
    assert {"date", "machine", "torch", "command", "setup", "goal"} <= r.keys()
    assert "load average" in r["machine"] and "--quick" in r["command"]
    runs = r["results"]["ring"]
    assert list(runs) == ["clean", "slow", "slow_deadline_5ms"]
    slow_rank, n = r["slow_rank"], 4
    for m in runs.values():
        assert len(m["steps_per_s"]) == len(m["distance_to_average"]) == n
        assert all(s > 0 for s in m["steps_per_s"])
        assert m["averaged_model_train_loss"] > 0
    clean, slow, deadline = runs["clean"], runs["slow"], runs["slow_deadline_5ms"]
    # without a deadline every rank waits for the slow one: far below the clean pace
    assert slow["fast_ranks_drop_mean"] > 0.4
    assert slow["slow_rank_exchanges_skipped"] == 0
    assert slow["slow_rank_exchanges_mixed"] == 2 * 30  # two ring neighbours, 30 steps
    assert clean["edges_skipped"] == [0] * n
    # with it, the fast ranks keep (most of) their pace and do skip the slow rank
    assert deadline["slow_rank_exchanges_skipped"] > 0
    assert deadline["fast_ranks_drop_mean"] < slow["fast_ranks_drop_mean"]
    assert deadline["steps_per_s"][slow_rank] < 0.5 * clean["steps_per_s"][slow_rank]
    for key in ("throughput_met", "slow_rank_counted", "met"):
        assert isinstance(deadline[key], bool) and isinstance(slow[key], bool)
    assert "met" not in clean
    table = render_stragglers(r)
    assert table.count("\n| ring |") == 3 and "slow_deadline_5ms" in table
