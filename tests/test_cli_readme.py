"""README says what is true: its set-up commands, the flags and extras it names, the speed
command, and the memory the V4-Flash checkpoint needs by the loader's storage rules today
(every tensor held in its stored format: the figures follow the official layout's bytes)."""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
from pathlib import Path

import pytest

from ds4.cli.main import parser as ds4_parser
from ds4.cli.server import parser as server_parser
from ds4.engine import Engine, default_model_dir
from ds4.model.checkpoint_names import expected_shapes, official_of
from ds4.model.config import ModelConfig
from ds4.model.official_format import F32_RE, FP4_RE, FP8_RE, write_official
from ds4.model.safetensors_file import read_checkpoint

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def section(title: str) -> str:
    """The text of README's `## title` section."""
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_set_up_is_still_two_commands() -> None:
    commands = [ln.strip() for ln in section("Set up").splitlines() if ln.startswith("    ")]
    assert commands == ["pip install -e . && ds4-server",
                        "pip install -e '.[test]' && python3 -m pytest -q"]


def test_every_extra_readme_installs_exists() -> None:
    extras = set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", README))
    assert extras == {"test", "gpu", "gpu-cuda13"}
    assert extras <= set(PROJECT["optional-dependencies"])


def test_the_server_synopsis_names_every_flag_and_no_other() -> None:
    synopsis = section("Talk to the server").split("    ds4-server ", 1)[1].split("\n\n")[0]
    named = set(re.findall(r"\[(--[\w-]+)", synopsis))
    flags = {o for a in server_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert named == flags - {"--help", "--version"}


def test_the_speed_command_is_a_valid_ds4_command() -> None:
    command = re.search(r"`(ds4 generate [^`]+)`", section("Speed"))[1]
    args = ds4_parser().parse_args(shlex.split(command)[1:])
    assert (args.max_tokens, args.backend) == (200, "numpy")


def flash_config() -> ModelConfig:
    """V4-Flash's configuration: 2 sliding, then CSA and HCA layers in turn (43)."""
    spec = importlib.util.spec_from_file_location("bench_flash", ROOT / "tools" / "bench_flash.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kinds = ["sliding_attention"] * 2 + ["compressed_sparse_attention" if i % 2 == 0 else
                                         "heavily_compressed_attention" for i in range(2, 43)]
    return ModelConfig.from_dict(bench.flash_config(kinds))


def parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(dense, routed-expert) parameter counts of a configuration."""
    dense = sum(math.prod(s) for n, s in expected_shapes(cfg).items()
                if not n.endswith("tid2eid"))
    experts = cfg.num_hidden_layers * cfg.n_routed_experts * 3 * cfg.moe_intermediate_size * \
        cfg.hidden_size
    return dense, experts


def flash_stored_bytes(cfg: ModelConfig) -> tuple[float, float]:
    """(non-expert, routed-expert) bytes of V4-Flash in the official layout: FP8 matrices with
    one scale byte per 128x128 tile, FP4 experts with one scale byte per 32 codes, hc_* /
    sinks / ape / router bias as F32, integer tables as I64, the rest BF16."""
    dense = 0
    for name, shape in expected_shapes(cfg).items():
        n, official = math.prod(shape), official_of(name)
        if name.endswith("tid2eid"):
            dense += 8 * n
        elif FP8_RE.search(official):
            dense += n + math.ceil(shape[0] / 128) * math.ceil(shape[-1] / 128)
        else:
            dense += (4 if F32_RE.search(official) else 2) * n
    return dense, parameters(cfg)[1] * (0.5 + 1 / 32)


def numpy_held_per_stored_byte(tmp_path: Path) -> tuple[float, float]:
    """(non-expert, routed-expert) bytes the NumPy loader holds per byte stored, measured on
    the tiny model written in the official layout: experts left in the file, then resident."""
    model = write_official(default_model_dir(), tmp_path / "official")
    stored = read_checkpoint(model)
    expert = {n: t for n, t in stored.items() if not n.startswith("mtp.")
              and FP4_RE.search(re.sub(r"\.scale$", ".weight", n))}
    rest = sum(t.nbytes for n, t in stored.items() if not n.startswith("mtp.")) - \
        sum(t.nbytes for t in expert.values())
    held = Engine.open(model, backend="numpy").memory_report()["weight_bytes"]
    streamed = Engine.open(model, backend="numpy", resident_experts=False)
    held_rest = streamed.memory_report()["weight_bytes"]
    return held_rest / rest, (held - held_rest) / sum(t.nbytes for t in expert.values())


def test_the_memory_figures_follow_the_loader(tmp_path: Path) -> None:
    dense_rate, expert_rate = numpy_held_per_stored_byte(tmp_path)
    cfg = flash_config()
    assert round(sum(parameters(cfg)) / 1e9) == 284 and "284B parameters" in README
    dense, experts = flash_stored_bytes(cfg)
    figures = {"dense": dense * dense_rate, "experts": experts * expert_rate}
    figures["numpy"] = figures["dense"] + figures["experts"]
    table = section("Run DeepSeek-V4-Flash")
    for name, pattern in [("numpy", r"about (\d+) GB of RAM: the checkpoint"),
                          ("experts", r"FP4 codes \+ scales \((\d+) GB"),
                          ("dense", r"F32 \((\d+) GB\)"),
                          ("dense", r"about (\d+) GB of RAM plus the page cache"),
                          ("numpy", r"about (\d+) GB \(\d+ GiB\) of GPU memory")]:
        stated = int(re.search(pattern, table)[1]) * 1e9
        assert abs(stated - figures[name]) / figures[name] < 0.05, (name, stated, figures)


def test_the_weights_source_and_download_are_named() -> None:
    text = section("Run DeepSeek-V4-Flash")
    assert "`deepseek-ai/DeepSeek-V4-Flash`" in text
    assert "hf download deepseek-ai/DeepSeek-V4-Flash --local-dir" in text
