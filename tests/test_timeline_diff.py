"""``benchmarks/timeline_diff.py``: kernels merged by their cut names, largest change first;
a file that is not a timeline is refused by name."""

import json

import pytest

from benchmarks.timeline_diff import kernel_deltas, load


def test_largest_change_first_with_names_cut_and_merged():
    study = {"ms_by_kernel": {"push_rows_a": 5.0, "push_rows_b": 1.0, "gemm": 10.0}}
    reference = {"ms_by_kernel": {"gemm": 12.5, "combine": 2.0}}
    rows = kernel_deltas(study, reference, width=9)
    assert rows == [(6.0, 0.0, "push_rows"), (10.0, 12.5, "gemm"), (0.0, 2.0, "combine")]


def test_a_file_without_the_phases_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"span_ms": 1.0}))
    with pytest.raises(SystemExit, match="x.json: not a scaling.py --timeline file"):
        load(str(path))
