"""tools/bench_switches.py on the CPU: it finds the decoder's switches and refuses a name that
is not one (its timing needs a GPU: the device runs it)."""

from __future__ import annotations

import pytest
from test_batch_tools import load_tool


def test_lists_the_decoders_switches_with_their_defaults(capsys):
    from ds4.kernels import rows, rows_moe
    from ds4.model import gpu_decode

    bench = load_tool("bench_switches")
    assert bench.main(["--list"]) == 0
    lines = dict(line.split(" = ") for line in capsys.readouterr().out.splitlines())
    assert lines["SHARED_AHEAD"] == str(gpu_decode.SHARED_AHEAD)
    assert lines["rows.STAGE_X"] == str(rows.STAGE_X)
    module = {"": gpu_decode, "rows": rows, "rows_moe": rows_moe}
    assert all(lines[name] == str(getattr(module[name.rpartition(".")[0]], name.split(".")[-1]))
               for name in lines)


@pytest.mark.parametrize("argv", [["--switch", "NO_SUCH_SWITCH"], []])
def test_a_name_that_is_no_switch_is_an_error(argv, capsys):
    bench = load_tool("bench_switches")
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and "--switch takes one of" in capsys.readouterr().err


def test_set_changes_an_integer_constant_and_refuses_anything_else(monkeypatch):
    from ds4.kernels import rows

    bench = load_tool("bench_switches")
    monkeypatch.setattr(rows, "STAGE_BATCH", rows.STAGE_BATCH)  # (restored after the test)
    assert bench.apply_sets(["rows.STAGE_BATCH=8"]) == [(rows, "STAGE_BATCH", 8)]
    assert rows.STAGE_BATCH == 8
    for bad in ("rows.STAGE_X=1", "rows.NO_SUCH=3"):  # a switch, a missing name
        with pytest.raises(ValueError, match="no integer constant"):
            bench.apply_sets([bad])


def test_a_switch_is_timed_off_and_on_in_turn_and_put_back(monkeypatch):
    """ab: each round measures the layer with the switch off, then on (a decoder built after
    each turn), takes the median of each side, and leaves the switch as it found it, also when
    a measurement fails."""
    from ds4.model import gpu_decode

    bench, seen = load_tool("bench_switches"), []

    class CuPy:
        @staticmethod
        def get_default_memory_pool():
            return type("Pool", (), {"free_all_blocks": lambda self: None})()

    times = iter([1.0, 5.0, 3.0, 7.0, 2.0, 6.0])  # off, on, off, on, off, on
    monkeypatch.setattr(bench, "layer_seconds", lambda *a: (seen.append(gpu_decode.SHARED_AHEAD),
                                                              next(times))[1])
    kept = gpu_decode.SHARED_AHEAD
    assert bench.ab(CuPy, None, "SHARED_AHEAD", 4096, 1, 3) == (2.0, 6.0)
    assert seen == [False, True] * 3 and gpu_decode.SHARED_AHEAD == kept
    with pytest.raises(StopIteration):  # the times ran out mid-measurement
        bench.ab(CuPy, None, "SHARED_AHEAD", 4096, 1, 1)
    assert gpu_decode.SHARED_AHEAD == kept
