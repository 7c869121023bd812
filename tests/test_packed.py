"""An official-format checkpoint (FP8 + FP4, sharded), quantised from the tiny model by
tools/make_official.py, held packed: the same logits as its values widened to fp32, the memory
report counting the packed bytes, and a load error naming each malformed tensor."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_gpu_decode_twins import twins  # noqa: F401  (the fixture: launchers -> NumPy twins)

from ds4.engine import Engine
from ds4.model.official_format import (
    official_tensors,
    official_values,
    write_dequantized,
    write_shards,
)
from ds4.model.weights import WeightsError

ROOT = Path(__file__).resolve().parents[1]
IDS = [0] + list(range(7, 4000, 41))  # 98 tokens: past the sliding window and some CSA rows
CHUNKS = [37, 1, 30, 3]  # a ragged prefill, then single-token decode steps


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(packed dir, dequantized fp32 dir), written by the tool's command line."""
    root = tmp_path_factory.mktemp("official")
    packed, plain = root / "packed", root / "plain"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_official.py"), "tiny", str(packed),
                    "--shard-mb", "8", "--dequantized", str(plain)], check=True, cwd=ROOT,
                   capture_output=True)
    return packed, plain


def _headers(model_dir: Path) -> dict:
    """name -> safetensors header entry over every shard of a checkpoint."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            out.update({k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"})
    return out


def test_tool_writes_the_official_layout(checkpoints):
    packed, _ = checkpoints
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["fmt"] == "e4m3" and config["expert_dtype"] == "fp4"
    index = json.loads((packed / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    h = _headers(packed)
    assert set(index) == set(h)
    assert h["layers.2.attn.wq_b.weight"]["dtype"] == "F8_E4M3"
    assert h["layers.2.attn.wq_b.scale"] == {**h["layers.2.attn.wq_b.scale"], "dtype": "F8_E8M0",
                                             "shape": [2, 1]}  # wq_b is [256, 32]
    assert h["layers.3.ffn.experts.5.w2.weight"]["dtype"] == "I8"
    assert h["layers.3.ffn.experts.5.w2.weight"]["shape"] == [64, 16]  # [D, I/2]
    assert h["layers.3.ffn.experts.5.w2.scale"]["shape"] == [64, 1]  # [D, I/32]
    for name, dtype in (("embed.weight", "BF16"), ("layers.2.ffn.gate.weight", "BF16"),
                        ("layers.2.attn.compressor.wkv.weight", "BF16"),
                        ("layers.2.hc_attn_fn", "F32"), ("layers.2.attn.attn_sink", "F32"),
                        ("layers.0.ffn.gate.tid2eid", "I64")):
        assert h[name]["dtype"] == dtype, name


def _compare(a: Engine, b: Engine) -> None:
    """Ragged prefill, every decode step, then snapshot/restore: logits within 1e-4, same argmax."""
    sa, sb = a.new_session(256), b.new_session(256)
    end = 0
    for n in CHUNKS:
        end += n
        _close(sa.sync(IDS[:end]), sb.sync(IDS[:end]))
    for t in IDS[end:end + 20]:
        _close(sa.decode(t), sb.decode(t))
    restored = a.new_session(256).restore(sa.snapshot())
    for t in IDS[end + 20:end + 24]:
        _close(restored.decode(t), sb.decode(t))


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert int(np.argmax(got)) == int(np.argmax(want))


@pytest.mark.parametrize("quantize", [False, True])
def test_packed_equals_dequantized_fp32(checkpoints, quantize):
    packed, plain = checkpoints
    a = Engine.open(packed, backend="numpy", prefill_chunk=16, quantize=quantize)
    b = Engine.open(plain, backend="numpy", prefill_chunk=16, quantize=quantize)
    assert a.model.weights.packed and not b.model.weights.packed
    _compare(a, b)


def test_quantize_is_on_by_default_for_packed(checkpoints):
    packed, plain = checkpoints
    assert Engine.open(packed, backend="numpy").model.quantize
    assert not Engine.open(plain, backend="numpy").model.quantize


def _used_bytes(model_dir: Path) -> int:
    """Stored bytes of every tensor the engine reads (the MTP block is mapped, never read)."""
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in _headers(model_dir).items()
               if not k.startswith("mtp."))


@pytest.mark.parametrize("resident", [True, False])
def test_weight_bytes_are_the_packed_bytes(checkpoints, resident):
    packed, _ = checkpoints
    report = Engine.open(packed, backend="numpy", resident_experts=resident).memory_report()
    stored = _used_bytes(packed)
    experts = sum(e["data_offsets"][1] - e["data_offsets"][0]
                  for k, e in _headers(packed).items()
                  if ".ffn.experts." in k and not k.startswith("mtp."))
    want = stored if resident else stored - experts
    assert abs(report["weight_bytes"] - want) <= 0.05 * want


def test_base_layout_scales_as_float32_and_ragged_blocks(tmp_path, checkpoints):
    _, plain = checkpoints
    values = official_values(plain)
    packed, ref = tmp_path / "packed", tmp_path / "ref"
    packed.mkdir()
    write_shards(packed, official_tensors(values, (48, 40), "f32"), 8 << 20)
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"fmt": "e4m3", "weight_block_size": [48, 40]}
    (packed / "config.json").write_text(json.dumps(config))
    write_dequantized(packed, ref)
    assert _headers(packed)["layers.2.attn.wq_b.scale"]["shape"] == [6, 1]  # ceil(256/48)
    a = Engine.open(packed, backend="numpy", quantize=False)
    b = Engine.open(ref, backend="numpy", quantize=False)
    _close(a.new_session(128).sync(IDS[:40]), b.new_session(128).sync(IDS[:40]))


# ---- malformed packed tensors: each a load error that names the tensor

@pytest.fixture(scope="module")
def official(checkpoints):
    """(tensors in official storage, config) of the packed fixture, to spoil one at a time."""
    packed, plain = checkpoints
    return official_tensors(official_values(plain)), (packed / "config.json").read_text()


def _spoiled(tmp_path: Path, official, change) -> Path:
    tensors, config = official
    tensors = dict(tensors)
    change(tensors)
    write_shards(tmp_path, tensors, 64 << 20)
    (tmp_path / "config.json").write_text(config)
    return tmp_path


WQ = "layers.2.attn.wq_b"
W2 = "layers.3.ffn.experts.5.w2"


def _drop_scale(t):
    del t[WQ + ".scale"]


def _wrong_scale_shape(t):
    t[WQ + ".scale"] = ("F8_E8M0", np.zeros((1, 1), np.uint8))


def _odd_packed_width(t):
    t[W2 + ".weight"] = ("I8", np.zeros((64, 17), np.int8))
    t[W2 + ".scale"] = ("F8_E8M0", np.zeros((64, 1), np.uint8))


def _expert_without_scale(t):
    del t[W2 + ".scale"]


def _scale_of_wrong_dtype(t):
    t[WQ + ".scale"] = ("I32", np.zeros((2, 1), np.int32))


@pytest.mark.parametrize("change, tensor, words", [
    (_drop_scale, WQ + ".weight", "no layers.2.attn.wq_b.scale"),
    (_wrong_scale_shape, WQ + ".weight", "expected [2, 1]"),
    (_odd_packed_width, W2 + ".weight", "packed width 17"),
    (_expert_without_scale, W2 + ".weight", "no .scale"),
    (_scale_of_wrong_dtype, WQ + ".weight", "expected F8_E8M0 or F32"),
])
def test_malformed_packed_tensor_is_a_load_error(tmp_path, official, change, tensor, words):
    model = _spoiled(tmp_path, official, change)
    with pytest.raises(WeightsError) as err:
        Engine.open(model, backend="numpy")
    assert tensor in str(err.value) and words in str(err.value)


def test_unknown_dtype_is_a_load_error(tmp_path, official):
    model = _spoiled(tmp_path, official, lambda t: None)
    shard = next(iter(sorted(model.glob("*.safetensors"))))
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    victim = next(k for k, v in header.items() if k.endswith("wq_b.weight"))
    text = raw[8:8 + n].replace(f'"{victim}": {{"dtype": "F8_E4M3"'.encode(),
                                f'"{victim}": {{"dtype": "F8_E5M2"'.encode())
    assert text != raw[8:8 + n]
    shard.write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(ValueError, match=f"{victim}.*F8_E5M2"):
        Engine.open(model, backend="numpy")


# ---- the decode graph's kernels on packed weights, run through their NumPy twins on CPU

@pytest.mark.parametrize("quantize", [False, True])
def test_kernel_decode_on_packed_weights_matches_the_engine(twins, checkpoints,  # noqa: F811
                                                            quantize):
    """The decode step the GPU captures as a graph (packed GEMVs, FP4 expert kernels, the
    FP8 / FP4 simulation kernels) equals the engine's model code, through the kernels' twins."""
    from ds4.model import gpu_weights
    from ds4.model.state import SessionState

    model = Engine.open(checkpoints[0], backend="numpy", quantize=quantize).model
    assert gpu_weights.supported(model) is None  # packed weights and simulation both covered
    decoder = twins.KernelDecoder.from_model(model)
    assert decoder.kv_fp8 == decoder.indexer_fp4 == quantize
    ref, mine = SessionState(np, model.cfg, 256), SessionState(np, model.cfg, 256)
    model.forward(ref, IDS[:60])
    model.forward(mine, IDS[:60])
    for t in IDS[60:80]:  # crosses CSA / HCA window closes (ratios 4 and 32)
        want = model.forward(ref, [t])
        _close(decoder.decode(mine, t), want)
