"""`lookup`'s terminal table shows a figure no run can have (a negative count of cores, a negative wall time: a
hand-edited or corrupt row) as '-', as tools/report.py leaves out a figure outside its range."""
from __future__ import annotations

from compat_check.lookup import AUDIT_SHOW, SHOW, format_table


def test_impossible_figures_are_shown_as_a_dash_and_possible_ones_as_they_are():
    cols = [c for c, _, _ in SHOW]
    row = dict.fromkeys(cols)
    row.update(model_id="m", task="text-generation", result="PASS", tp=-5, wall_s=-2147483648.0, hbm_peak_gb=-1.0,
               compile_graphs=-3, compile_recompiles=2, compile_graph_breaks=0)
    header, line = format_table([[row[c] for c in cols]], SHOW).splitlines()
    cells = dict(zip([t for _, t, _ in SHOW], line.split()))
    assert (cells["cores"], cells["wall_s"], cells["hbm_peak_gb"], cells["graphs"]) == ("-", "-", "-", "-"), line
    assert (cells["recompiles"], cells["graph_breaks"]) == ("2", "0"), line
    row.update(tp=0)  # no run has zero cores either
    assert format_table([[row[c] for c in cols]], SHOW).splitlines()[1].split()[3] == "-"
    assert {c for c, _, _ in AUDIT_SHOW} <= set(cols)
