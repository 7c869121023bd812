"""Smoke tests of the batched-decode benchmarks on the tiny model (CPU): each prints a row per
batch size / stream count with positive rates."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    sys.path.insert(0, str(TOOLS))  # the tools import each other by module name
    try:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    return module


def table_rows(out: str) -> list[list[str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_bench_batch_prints_a_row_per_batch_size(capsys, tmp_path):
    bench = load_tool("bench_batch")
    out = tmp_path / "batch.json"
    assert bench.main(["--batch", "1,2,3", "--steps", "1", "--prompt", "9",
                       "--json", str(out)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert float(rows[0][4]) == 2.0  # one session, tiny model: top-2 experts per layer
    assert float(rows[2][4]) >= float(rows[0][4])  # more rows pick at least as many experts
    assert out.read_text().startswith("{")


def test_bench_batch_times_the_graph_of_the_batch_sizes_bound(monkeypatch):
    """graph_seconds replays the step graph of the smallest captured size >= the batch (3 -> 4),
    from the GraphDecode's KernelDecoder (the device machine's first run failed here)."""
    from types import SimpleNamespace as NS

    bench = load_tool("bench_batch")
    monkeypatch.syspath_prepend(str(TOOLS))
    launched, clock = [], iter(range(1000))

    class Event:
        def record(self):
            self.t = next(clock)

        def synchronize(self):
            pass

    cp = NS(cuda=NS(Event=Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3))
    graph4 = NS(launch=lambda stream: launched.append(4))
    stream = type("Stream", (), {"__enter__": lambda s: s, "__exit__": lambda s, *a: None})()
    decoder = NS(graphs={1: None, 4: graph4}, stream=stream)
    engine = NS(model=NS(kernel_decoder=NS(decoder=decoder)), backend=NS(xp=cp))
    assert bench.graph_seconds(engine, 3) == pytest.approx(0.1)  # 1 s per ten replays
    assert launched and set(launched) == {4}
    assert bench.graph_seconds(engine, 1) is None  # no graph captured for that size yet
    assert bench.graph_seconds(NS(model=NS(kernel_decoder=None)), 1) is None  # NumPy engine


def test_bench_parallel_streams_mode(capsys):
    bench = load_tool("bench_parallel")
    assert bench.main(["--streams", "1,2", "--stream-tokens", "10", "--repeat", "1"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(float(r[1]) > 0 for r in rows)
    assert float(rows[0][4]) == 1.0  # one stream: every step decodes one session
    bounds = [float(r[5]) for r in rows]  # a batch reads shared bytes once: a higher bound
    assert 0 < bounds[0] <= bounds[1] and all(0 < float(r[6].rstrip("%")) for r in rows)


def test_bench_parallel_streams_mode_samples_at_a_temperature(capsys):
    bench = load_tool("bench_parallel")
    assert bench.main(["--streams", "2", "--stream-tokens", "8", "--repeat", "1",
                       "--temperature", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "8 temperature 0.8 tokens per stream" in out
    assert float(table_rows(out)[0][1]) > 0


def test_bench_mtp_keeps_plain_tokens_on_a_model_cut_to_its_first_layers(capsys):
    bench = load_tool("bench_mtp")
    assert bench.main(["--backend", "numpy", "--tokens", "6", "--prompt-tokens", "12",
                       "--drafts", "2", "--layers", "4", "--load-format", "dummy"]) == 0
    out = capsys.readouterr().out
    assert "(first 4 layers)" in out
    rows = {r[0]: r for r in table_rows(out)}
    assert rows["forced"][3] == "100.0%" and rows["forced"][5] == "yes"
    assert rows["mtp"][5] == "yes" and float(rows["plain"][2]) > 0


def test_bench_gpus_compares_each_group_with_one_gpu(capsys):
    """tools/bench_gpus.py on the tiny model's CPU twin of a group: one row per engine, the
    group rows with the one-GPU engine's greedy tokens."""
    bench = load_tool("bench_gpus")
    assert bench.main(["--model", "tiny", "--load-format", "auto", "--backend", "numpy",
                       "--gpus", "2,3", "--concurrency", "1,2", "--prompt-tokens", "40",
                       "--tokens", "3"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["one GPU, no group", "--gpus 2", "--gpus 3"]
    assert all(r[4] == "same" for r in rows)
    assert all(float(r[1].split()[0]) > 0 for r in rows)


def test_row_ablations_still_patch_the_kernel_sources(tmp_path):
    """tools/ablate_rows.py removes each part by replacing text of the row kernels: every
    ablation must still find its text (once) in the current sources, and change them."""
    ablate = load_tool("ablate_rows")
    base = ablate.patched("base", tmp_path)
    for name, edits in ablate.ABLATIONS.items():
        d = ablate.patched(name, tmp_path)
        changed = {f for f, _, _ in edits}
        for f in changed:
            assert (d / f).read_text() != (base / f).read_text(), (name, f)


def test_bench_rows_counts_the_routed_gate_up_items_as_the_launcher_does(monkeypatch):
    bench = load_tool("bench_rows")
    assert bench.gate_up_items(1, 6, 6) == 192  # 6 experts of 32 row tiles (64 rows each)
    assert bench.gate_up_items(8, 6, 44) == 44 * 32 * 2  # two passes over 5..8 tokens
    assert bench.gate_up_items(2, 6, 11.5) == 11.5 * 32  # a mean over pick sets
    from ds4.kernels import rows_moe

    monkeypatch.setattr(rows_moe, "ITEM_WARPS", 4)  # blocks of 4 warps: half the rows
    assert bench.gate_up_items(1, 6, 6) == 384
    monkeypatch.setattr(rows_moe, "ITEM_WARPS", 2)
    assert bench.gate_up_items(1, 6, 6) == 768
    monkeypatch.setattr(rows_moe, "ITEM_WARPS", 8)
    assert bench.gate_up_items(1, 6, 6, shared=True) == 224  # the layer's: 7 x 32 tiles


def test_profile_prefill_accounts_for_the_whole_chunk_and_unwraps(capsys):
    """The function table's own times add up to the timed run, each layer kind reports its
    own functions (only CSA has an indexer), and the model code is unwrapped afterwards."""
    from ds4.model import attention, linear

    before = (attention.linear, linear.linear, attention.attention)
    tool = load_tool("profile_prefill")
    assert tool.main(["--small", "--backend", "numpy", "--chunk", "48",
                      "--layers", "sliding,csa"]) == 0
    assert (attention.linear, linear.linear, attention.attention) == before
    blocks = capsys.readouterr().out.split("chunk 48: ")[1:]
    assert len(blocks) == 2
    for block, has_indexer in zip(blocks, (False, True)):
        total = float(block.split(" ms")[0])
        rows = {ln.split()[0]: ln.split()[1:] for ln in block.splitlines()[2:]
                if len(ln.split()) == 5}  # not the next kind's name
        own = sum(float(r[2]) for r in rows.values())
        assert abs(own - total) < 0.1 * total  # the wrapped calls cover the run
        assert int(rows["Model._layer"][0]) == 1 and "routed" not in rows  # NumPy: no kernels
        assert ("select_entries" in rows) == has_indexer


def test_bench_cpu_prints_prefill_against_its_floor_and_sampled_decode(capsys):
    bench = load_tool("bench_cpu")
    assert bench.main(["--prompt", "300", "--chunk", "64", "--streams", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    prefill = next(ln for ln in out.splitlines() if ln.startswith("prefill of 300 tokens"))
    assert float(prefill.split("(")[-1].rstrip("x)")) > 1.0  # slower than its FLOP floor
    decode = next(ln for ln in out.splitlines() if ln.startswith("decode, 2 streams"))
    assert float(decode.split(": ")[1].split(" ms")[0]) > 0


def test_ablate_rows_squeezes_the_l1_of_the_expert_launches_alone(monkeypatch):
    """ablate_rows' l1_squeezed: the MoE's gate/up and down launches ask for its unused shared
    memory and the largest carveout; the grouping and the sum launch as they are; off, the
    launcher is rows_moe's own again."""
    import ds4.kernels as K
    from ds4.kernels import rows_moe

    ablate, calls, carveouts = load_tool("ablate_rows"), [], {}

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __setattr__(self, key, value):
            if key == "preferred_shared_memory_carveout":
                carveouts[self.name] = value
            object.__setattr__(self, key, value)

    monkeypatch.setattr(K, "kernel", lambda family, name: Kernel(name))
    monkeypatch.setattr(rows_moe, "launch", rows_moe.launch)  # (restored should an assert fail)
    ablate.squeeze_l1(True, plain=lambda *a, shared=0: calls.append((a[1], shared)))
    for name in ("rows_gate_up_xs_fp4_fp8_n1", "rows_down_xs_fp4_none_n1", "rows_moe_sum"):
        rows_moe.launch("rows_moe", name, (1,), (256,), ())
    assert calls == [("rows_gate_up_xs_fp4_fp8_n1", ablate.SQUEEZE_BYTES),
                     ("rows_down_xs_fp4_none_n1", ablate.SQUEEZE_BYTES), ("rows_moe_sum", 0)]
    assert carveouts == {"rows_gate_up_xs_fp4_fp8_n1": 100, "rows_down_xs_fp4_none_n1": 100}
    ablate.squeeze_l1(False)
    assert rows_moe.launch is K.launch


def test_bench_sources_builds_the_named_families_from_the_base_copy(monkeypatch, tmp_path):
    """bench_sources' base build: a family it takes compiles the base copy's text with that
    directory on the include path and its own headers' checksum (not the repository's); the
    other families and, after use(None), every family come from the repository's loader."""
    import ds4.kernels as K
    from ds4.backend import KERNEL_DIR

    sources, built = load_tool("bench_sources"), []
    (tmp_path / "common.cuh").write_text("// base header\n")
    (tmp_path / "attention.cu").write_text("// base attention\n")

    class CuPy:
        @staticmethod
        def RawModule(code, options):  # noqa: N802 (CuPy's name)
            built.append((code, options))
            return "base module"

    monkeypatch.setattr(K, "_module", K._module)  # (restored should an assert fail)
    plain = lambda family: f"repository {family}"  # noqa: E731
    sources.use(CuPy, tmp_path, {"attention"}, plain=plain)
    assert K._module("attention") == "base module" and K._module("rows") == "repository rows"
    K._module("attention")  # built once
    assert len(built) == 1 and built[0][0] == "// base attention\n"
    assert f"-I{tmp_path}" in built[0][1] and f"-I{KERNEL_DIR}" not in built[0][1]
    assert f"-DDS4_HEADERS={zlib.crc32(b'// base header' + bytes([10]))}" in built[0][1]
    sources.use(CuPy, None, plain=plain)
    assert K._module("attention") == "repository attention"
    with pytest.raises(SystemExit) as exit_:  # no common.cuh there: a usage error, no GPU
        sources.main(["--base", str(tmp_path / "none")])
    assert exit_.value.code == 2


def test_bench_stream_plans_whole_scale_words_near_the_warps_asked():
    """bench_stream's launch plan: the k-split doubles while it stays at or under the warps
    asked and each k-span holds whole groups of four k-tiles (a scale word's); its warps read
    the whole stack of whole row groups; a row length of no whole four k-tiles is a usage
    error (before any GPU)."""
    stream = load_tool("bench_stream")
    total = 28320 * 2048  # 58 MB of 2 KB rows: a B=1 gate/up
    assert stream.plan(total, 2048, 1792, 2) == (2, 1770)  # 885 groups of 32 rows
    assert stream.plan(total, 2048, 1792, 1) == (1, 1770)
    assert stream.plan(total, 2048, 10 ** 6, 2) == (8, 7080)  # spans of 256 bytes at the most
    for tiles, depth, scales, contig in stream.PATTERNS:
        ks, warps = stream.plan(total, 2048, 1792, tiles)
        assert (2048 // ks) % (4 * stream.STEP) == 0 and warps <= 1792
        assert warps // ks == total // 2048 // (16 * tiles)  # whole row groups
        assert scales in (0, 1, 4) and depth in (1, 2, 4)
    with pytest.raises(SystemExit) as exit_:
        stream.main(["--row-bytes", "1000"])
    assert exit_.value.code == 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_bench_stream_patterns_compile_for_sm90(tmp_path):
    """Every bench_stream pattern's kernel builds (nvcc, sm_90, no spills): a pattern that does
    not compile would only show on the device."""
    stream = load_tool("bench_stream")
    src = tmp_path / "stream.cu"
    src.write_text(stream.SOURCE)
    for tiles, depth, scales, contig in stream.PATTERNS:
        proc = subprocess.run(
            ["nvcc", "-arch=sm_90", "--cubin", "-std=c++17", "-Xptxas", "-warn-spills",
             f"-DMT={tiles}", f"-DDEPTH={depth}", f"-DSCALES={scales}", f"-DCONTIG={int(contig)}",
             "-o", str(tmp_path / "stream.cubin"), str(src)],
            capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0 and "spill" not in proc.stderr.lower(), proc.stderr


def test_ablate_launches_drops_only_the_named_kernels_and_only_while_capturing(monkeypatch):
    """ablate_launches' patch: every ds4 module's launch drops the matching kernels inside a
    capture (the eager step before it runs them all), records what the capture launched, and
    the real launch comes back; `small` leaves the weight streams in."""
    import types

    tool, calls, capturing = load_tool("ablate_launches"), [], [False]
    real = lambda family, name, *a: calls.append(name)  # noqa: E731
    fake = types.ModuleType("ds4._fake_family")
    fake.launch = real
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(tool, "REAL_LAUNCH", real)
    seen = []
    tool.skip_launches("rows_split|moe_route", lambda: capturing[0], seen)
    for state in (False, True):
        capturing[0] = state
        for name in ("rows_split", "moe_route_8", "hc_unit"):
            fake.launch("rows", name, (1,), (32,), ())
    assert calls == ["rows_split", "moe_route_8", "hc_unit", "hc_unit"]
    assert seen == ["rows_split", "moe_route_8", "hc_unit"]
    tool.skip_launches(None, lambda: True)
    assert fake.launch is real
    small = re.compile(tool.GROUPS["small"])
    assert all(small.search(n) for n in ("rows_split", "moe_route_8", "attention_combine"))
    assert not any(small.search(n) for n in ("rows_gate_up_xs_fp4_none_n1", "rows_many_n2",
                                             "attention_partial_m", "rows_matvec_Fp8h_m2_d4_n2"))
    with pytest.raises(SystemExit) as exit_:  # neither --skip nor --each: usage, no GPU
        tool.main(["--layers", "csa"])
    assert exit_.value.code == 2
