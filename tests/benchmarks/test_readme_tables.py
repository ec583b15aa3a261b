"""README.md's benchmark tables are what `python -m benchmarks.readme` makes of the committed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.readme import BEGIN, END, main, render, tables


def test_readme_tables_are_current() -> None:
    assert main(["--check"]) == 0, "run: python -m benchmarks.readme"


def test_tables_show_rows_with_a_peer_and_skip_missing_areas(tmp_path: Path) -> None:
    rows = [
        {"case": "decode", "value": 1.5, "unit": "us", "peer": "ref 3 us", "ratio": 2.0},
        {"case": "peak memory", "value": 3, "unit": "MiB", "peer": "", "ratio": None},
    ]
    (tmp_path / "avp.json").write_text(json.dumps({"rows": rows, "machine": {"python": "3.11"}, "quick": True}))
    text = tables(tmp_path)
    assert "| decode | 1.5 us | ref 3 us | 2.00x |" in text
    assert "peak memory" not in text and "ipc" not in text
    assert "--quick" in text


def test_render_needs_both_markers() -> None:
    assert render(f"a\n{BEGIN}\nold\n{END}\nb", "new") == f"a\n{BEGIN}\n\nnew\n\n{END}\nb"
    with pytest.raises(ValueError):
        render("no markers", "new")
