"""tools/bench_serve.py against a live server: a short Poisson run on each route prints the
vLLM-shaped table with every request counted, and a bad --goodput is refused."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_server_support import free_port, live_server

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_serve.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_serve", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rows(text: str) -> dict[str, str]:
    """Label → value of the table's rows."""
    return {label.strip(): value.strip() for label, _, value in
            (ln.rpartition(":") for ln in text.splitlines()) if label}


@pytest.fixture(scope="module")
def url():
    with live_server(parallel=2, ctx=1024) as (base, _runtime):
        yield base


@pytest.mark.parametrize("backend", ["openai-chat", "anthropic"])
def test_a_short_run_prints_the_table(url, backend, capsys, tmp_path):
    bench = load_tool()
    saved = tmp_path / "result.json"
    assert bench.main(["--base-url", url, "--backend", backend, "--num-prompts", "3",
                       "--request-rate", "20", "--random-input-len", "24",
                       "--random-output-len", "6", "--goodput", "ttft:60000", "tpot:60000",
                       "--metric-percentiles", "90,99", "--save-result", str(saved)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    got = rows(out)
    assert got["Successful requests"] == "3" and got["Failed requests"] == "0"
    assert got["Request goodput (req/s)"] == got["Request throughput (req/s)"]  # loose SLOs
    assert 3 <= int(got["Total generated tokens"]) <= 18
    assert int(got["Total input tokens"]) >= 3 * 24  # the template adds its own tokens
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert float(got[f"Mean {metric} (ms)"]) > 0
        assert float(got[f"P99 {metric} (ms)"]) >= float(got[f"P90 {metric} (ms)"])
    assert json.loads(saved.read_text())["table"]["Successful requests"] == 3
    if backend == "anthropic":
        return
    other = tmp_path / "p2.json"  # a second run's file, as the --parallel columns are
    other.write_text(saved.read_text().replace('"Successful requests": 3', '"x": 0'))
    assert bench.main(["--compare", str(saved), str(other)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split("|")[1:4] == [f" {'metric':33} ", f" {'result':>12} ",
                                        f" {'p2':>12} "]
    mean_ttft = next(row for row in table if row.startswith("| Mean TTFT (ms)"))
    assert mean_ttft.split("|")[2].strip() == f"{float(got['Mean TTFT (ms)']):.2f}"
    assert len(table) == 2 + len(json.loads(saved.read_text())["table"]) - 2


def test_a_bad_goodput_is_refused(capsys):
    bench = load_tool()
    with pytest.raises(Exception, match="ttft|tpot|e2el"):
        bench.main(["--goodput", "latency:5"])


def test_warm_ups_are_sent_first_and_not_counted(url, capsys):
    bench = load_tool()
    assert bench.main(["--base-url", url, "--num-prompts", "2", "--num-warmups", "2",
                       "--random-input-len", "8", "--random-output-len", "3"]) == 0
    captured = capsys.readouterr()
    assert "bench_serve: 2 warm-up request(s), 0 failed" in captured.err
    got = rows(captured.out)
    assert got["Successful requests"] == "2" and 2 <= int(got["Total generated tokens"]) <= 6


def test_a_server_that_never_comes_up_is_said_after_the_ready_timeout():
    bench = load_tool()
    base = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=f"bench_serve: {base} not ready after 1 s"):
        bench.main(["--base-url", base, "--num-prompts", "1", "--ready-check-timeout-sec", "1"])
