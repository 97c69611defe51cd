"""The compatibility check's rows and page data, in-process: an earlier results file's measured seconds survive its
conversion to the public types, and the lookup page, meant to be shared, names no folder of this machine."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from compat_check import page, rows


def test_a_float_wall_s_keeps_its_seconds_where_wall_s_precise_is_null():
    """An earlier file's float wall_s beside a wall_s_precise column null in some or all rows: the public types round
    wall_s, and the measured seconds stay in wall_s_precise (a row's own precise value first)."""
    for precise in (pa.nulls(2, pa.float64()), pa.array([12.71, None]), None):
        columns = {"model_id": ["a", "b"], "wall_s": pa.array([12.7, 3.2])}
        if precise is not None:
            columns["wall_s_precise"] = precise
        written = rows._as_written(pa.table(columns), rows._arrow_schema())
        assert written.column("wall_s").to_pylist() == [13, 3]
        first = 12.71 if precise is not None and precise.null_count == 1 else 12.7
        assert written.column("wall_s_precise").to_pylist() == [first, 3.2], precise


def test_the_page_names_no_folder_of_this_machine(monkeypatch, tmp_path):
    """The judge model's path (in the set-up's cache), a source file under the home folder and a compile cache there
    are written as $QWEN3_RECIPES_CACHE/... and ~/... in everything the page embeds; other text is left as it is."""
    import pandas as pd

    home = tmp_path / "home" / "alice"
    cache = home / ".cache" / "qwen3-trainium-recipes"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("QWEN3_RECIPES_CACHE", str(cache))
    judge = json.dumps({"english": True, "model": f"{cache}/assets/smollm2"})
    df = rows.normalize(pd.DataFrame([{
        "model_id": "org/model", "result": "PASS", "judge": judge, "source_file": f"{home}/runs/results.parquet",
        "compile_cache": f"TORCHINDUCTOR_CACHE_DIR={home}/inductor", "notes": "/srv/shared stays as it is",
        "run_args": json.dumps(["--out_dir", f"{home}/runs"])}]))
    data = page.page_data(df, (), [f"{home}/runs/results.parquet"], rerun=json.loads)
    text = json.dumps(data)
    assert str(home) not in text and "alice" not in text, text
    cells = dict(zip(data["columns"], data["rows"][0]))
    assert json.loads(cells["judge"])["model"] == "$QWEN3_RECIPES_CACHE/assets/smollm2"
    assert cells["source_file"] == "~/runs/results.parquet" and data["sources"] == ["~/runs/results.parquet"]
    assert cells["compile_cache"] == "TORCHINDUCTOR_CACHE_DIR=~/inductor"
    assert cells["rerun"] == "python generate_compat_check.py --out_dir ~/runs"  # the shell finds it in its home
    spaced = page.page_data(df.assign(run_args=json.dumps(["--out_dir", f"{home}/my runs; rm x"])), (), [],
                            rerun=json.loads)
    assert dict(zip(spaced["columns"], spaced["rows"][0]))["rerun"] == \
        "python generate_compat_check.py --out_dir ~/'my runs; rm x'"  # the rest of the path quoted
    assert cells["notes"] == "/srv/shared stays as it is"
