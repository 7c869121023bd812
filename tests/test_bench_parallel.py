"""Smoke test of tools/bench_parallel.py with tiny numbers: it starts both real servers, streams
both clients and prints the settings line and a full table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_parallel.py"


def load_tool():
    sys.path.insert(0, str(TOOL.parent))  # it imports bench_batch by module name
    try:
        spec = importlib.util.spec_from_file_location("bench_parallel", TOOL)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOL.parent))
    return module


def test_bench_prints_settings_a_row_per_measure_and_the_goals(capsys):
    """One server after the other (as at full size), then the table and the two goals."""
    bench = load_tool()
    assert bench.main(["--tokens-a", "24", "--b-after", "4", "--prompt-b-tokens", "300",
                       "--tokens-b", "3", "--prefill-ms", "20", "--repeat", "1",
                       "--sequential"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "300-token prompt sent at A's token 4" in lines[0]
    assert "DS4_SERVER_SCHED_PREFILL_MS=20" in lines[0] and "load average" in lines[0]
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[3:]
             if line.startswith("|"))}
    assert rows["A tokens"] == ["24", "24", "1.00x"]
    assert rows["B tokens"] == ["3", "3", "1.00x"]
    assert set(rows) == {"B TTFT (s)", "B total (s)", "A worst gap during B prefill (s)",
                         "A gap before B (s)", "A total (s)", "A tokens", "A decode tok/s",
                         "B tokens", "B decode tok/s"}
    assert all(float(v) > 0 for v in rows["B TTFT (s)"][:2])
    ttft, gap = lines[-2:]
    assert ttft.startswith(f"goal at --parallel 2: B's TTFT {rows['B TTFT (s)'][1]} s <= 1 s: ")
    burst = bench.SchedulerConfig.from_env().decode_tokens
    assert f"<= prefill slice 0.020 s + decode burst {burst} x " in gap
    assert gap.endswith((": met", ": missed"))


def test_model_backend_and_load_format_pass_through_to_the_server():
    bench = load_tool()
    args = bench.parser().parse_args(["--model", "deepseek-v4-flash", "--backend", "cupy",
                                      "--load-format", "dummy", "--gpu-memory-gib", "120"])
    assert bench.model_flags(args) == ["--model", "deepseek-v4-flash", "--load-format", "dummy",
                                       "--gpu-memory-gib", "120.0"]
    assert args.backend == "cupy"
    plain = bench.parser().parse_args([])
    assert bench.model_flags(plain) == [] and plain.backend == "numpy"  # nothing unasked
    assert bench.settings(args, 0.0).startswith("deepseek-v4-flash (dummy), cupy, ")
