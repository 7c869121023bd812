"""profile_decode's host side (CPU): the child's command, the head's floor line and ncu's CSV
read into kernel times."""

from __future__ import annotations

from test_batch_tools import load_tool


def test_child_values_read_the_graph_and_head_floor_lines_and_none_for_a_layer():
    tool = load_tool("profile_decode")
    out = "graph 512.3\nfloor 353.0 1059\n"
    assert tool.child_values(out, "graph") == [512.3]
    assert tool.child_values(out, "floor") == [353.0, 1059.0]
    assert tool.child_values("graph 145.7\n", "floor") is None


def test_kernel_times_reads_ncu_csv_in_microseconds():
    tool = load_tool("profile_decode")
    pad = ",".join(["x"] * 8)
    csv = ('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value",' + pad + "\n"
           '"0","rows_matvec","gpu__time_duration.sum","usecond","12.5",' + pad + "\n"
           '"1","hc_unit","gpu__time_duration.sum","nsecond","1,500",' + pad + "\n")
    assert tool.kernel_times(csv) == [("rows_matvec", 12.5), ("hc_unit", 1.5)]


def test_child_command_names_the_kind_position_and_batch():
    tool = load_tool("profile_decode")
    cmd = tool.child_command("head", 4096, 8)
    assert cmd[-6:] == ["--child", "head", "--ctx", "4096", "--batch", "8"]
