"""The MoE of one decode layer for the members of a batch graph (ds4/model/gpu_decode.py).

`moe_rows` goes through ds4/kernels/rows_moe.py's `moe` (each distinct expert read once for all
members; it can also read placed experts, in device or mapped host memory, through their
address tables, host ones first, counting their picks for re-placement: see ROWS_READ_PLACED)
where it reads the layer's experts; placed experts and formats rows_moe.moe lacks run the
single-token kernels per member. Idle members of a graph (at or past the member table's live
count) count no pick on either path, and on rows_moe.moe's read no routed expert."""

from __future__ import annotations

from ds4.kernels import moe, rows, rows_moe
from ds4.model import gpu_batch
from ds4.model.packed import FP8, PackedMatrix

SHARED = ("gate_proj", "up_proj", "down_proj")
# Placed experts through rows_moe.moe's address tables: each distinct expert read once per
# batch, but its host rows in 64-byte pieces over PCIe, where placed.cu reads 512 contiguous
# bytes a warp. On the H200 the per-member placed.cu kernels were faster at every batch size
# under uniform routing (B=1 420 vs 496 us, B=8 3.50 vs 3.87 ms a layer with a quarter of the
# experts on the host, tools/bench_rows.py --placed): few members share a host expert, so the
# once-per-batch read saves less than the narrower reads cost. Off until routing that members
# share (real checkpoints' skew) measures otherwise; the tests cover both paths.
ROWS_READ_PLACED = False


def moe_rows(cfg, t: dict, buf: dict, rows: list, batch: int, scratch=None, live=None,
             shared_done=None) -> None:
    """buf["y"][b] = routed experts + shared expert of buf["h"][b], routes in buf["idx"/"wts"];
    scratch: rows_moe.moe's buffers where it reads this layer (row_moe_fits), else None; live:
    the member table's live count (device int32 [1]; None: every member is live);
    shared_done: rows_moe.shared_ahead's event (the shared expert already launched)."""
    counts = t.get("experts.counts")  # placed experts: routing picks for re-placement
    if scratch is not None:
        shared = shared_of(t)
        rows_moe.moe(t["experts.gate_up"], t["experts.down"], buf["idx"], buf["wts"],
                     buf["h"], scratch, buf["y"], batch, cfg.moe_intermediate_size,
                     cfg.swiglu_limit, shared=shared, counts=counts, live=live,
                     shared_done=shared_done)
        return
    # the single-token kernels once per member: formats rows_moe.moe does not read
    for b in range(batch):
        experts_one(cfg, t, rows[b], live, b)


def shared_ahead(cfg, t: dict, buf: dict, batch: int, scratch, stream):
    """The shared expert of the moe_rows call that follows (same layer, buffers and scratch),
    launched now on `stream` by rows_moe.shared_ahead; its event for moe_rows' shared_done, or
    None where nothing was launched (no scratch: the per-member kernels; or a layer that
    rows_moe.moe fuses anyway)."""
    if scratch is None:
        return None
    return rows_moe.shared_ahead(t["experts.gate_up"], t["experts.down"], buf["idx"], buf["h"],
                                 scratch, batch, cfg.moe_intermediate_size, cfg.swiglu_limit,
                                 shared_of(t), stream)


def shared_of(t: dict) -> tuple | None:
    """The layer's shared expert (gate, up, down), None without one."""
    gate = t.get("mlp.shared_experts.gate_proj.weight")
    return None if gate is None else tuple(t[f"mlp.shared_experts.{n}.weight"] for n in SHARED)


def row_moe_fits(t: dict, members: int, k: int) -> bool:
    """Whether rows_moe.moe reads this layer's routed and shared experts for `members` tokens."""
    gu, down = t["experts.gate_up"], t["experts.down"]
    if gpu_batch.row_kernels is None or members * k > rows_moe.MAX_PAIRS:
        return False  # (None: the twins tests' per-row fallback)
    if getattr(gu, "placed", False) and not ROWS_READ_PLACED:
        return False
    ops = [rows_moe.stack_of(gu), rows_moe.stack_of(down)]
    sops = [rows.operand(m) for m in (shared_of(t) or ())]
    if None in ops + sops or ops[0].fmt != ops[1].fmt \
            or getattr(gu, "placed", False) != getattr(down, "placed", False):
        return False
    return not sops or (ops[0].fmt, sops[0].fmt) in rows_moe.MOE_KERNELS


def row_moe_scratch(xp, cfg, layers: list[dict], members: int):
    """rows_moe.moe's buffers for `members` tokens, sized for every layer's shared expert; None
    when no layer is read by rows_moe.moe."""
    k = cfg.num_experts_per_tok
    if not any(row_moe_fits(t, members, k) for t in layers):
        return None
    inter = max([t["mlp.shared_experts.gate_proj.weight"].shape[0] for t in layers
                 if "mlp.shared_experts.gate_proj.weight" in t] + [0])
    return rows_moe.moe_scratch(xp, members, k, cfg.moe_intermediate_size, cfg.hidden_size,
                                inter)


def experts_one(cfg, t: dict, r: dict, live=None, member: int = 0) -> None:
    """r["y"] = routed experts + shared expert of r["h"] (one member's row views; live and
    member: whether its picks count, see moe_rows)."""
    gu = t["experts.gate_up"]
    if getattr(gu, "placed", False):
        _placed(cfg, t, r, live, member)
    elif isinstance(gu, PackedMatrix):
        _packed(cfg, t, r)
    else:
        _plain(cfg, t, r)


def _plain(cfg, t: dict, r: dict) -> None:
    """bf16-word (or fp32) experts through ds4/kernels/moe.cu."""
    inter, limit, k = cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.num_experts_per_tok
    gu = t["experts.gate_up"]
    shared = [t.get(f"mlp.shared_experts.{n}.weight") for n in SHARED]
    if shared[0] is not None and (shared[0].dtype != gu.dtype or shared[0].shape[0] != inter):
        shared = [None, None, None]  # the kernels take a shared expert shaped like a routed one
    act = r["act"] if shared[0] is not None else r["act"][:k]
    moe.moe_gate_up(gu[:, :inter], gu[:, inter:], r["idx"], r["wts"], r["h"], act, limit,
                    shared[0], shared[1])
    moe.moe_down(t["experts.down"], r["idx"], act, r["y"], shared_down=shared[2])
    if "mlp.shared_experts.gate_proj.weight" in t and shared[0] is None:
        sact = r["act"][k:]
        moe.moe_gate_up(t["mlp.shared_experts.gate_proj.weight"],
                        t["mlp.shared_experts.up_proj.weight"], None, None, r["h"], sact, limit)
        moe.moe_down(t["mlp.shared_experts.down_proj.weight"], None, sact, r["y"],
                     accumulate=True)


def _packed(cfg, t: dict, r: dict) -> None:
    """The picked experts' FP4 (or FP8) codes and the shared expert read in place by
    ds4/kernels/packed.cu."""
    from ds4.kernels import packed

    inter, limit, k = cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.num_experts_per_tok
    gu, down = t["experts.gate_up"], t["experts.down"]
    halves = [(gu.codes[:, :inter], gu.scale[:, :_scale_rows(gu, inter)]),
              (gu.codes[:, inter:], gu.scale[:, _scale_rows(gu, inter):])]
    act = r["act"][:k]
    if gu.fmt == FP8:
        packed.moe_gate_up_fp8(*halves[0], *halves[1], gu.block[0], r["idx"], r["wts"],
                               r["h"], act, limit)
        packed.moe_down_fp8(down.codes, down.scale, down.block[0], r["idx"], act, r["y"])
    else:
        packed.moe_gate_up_fp4(*halves[0], *halves[1], r["idx"], r["wts"], r["h"], act, limit)
        packed.moe_down_fp4(down.codes, down.scale, r["idx"], act, r["y"])
    if "mlp.shared_experts.gate_proj.weight" in t:
        _shared_expert(cfg, t, r)


def _placed(cfg, t: dict, r: dict, live=None, member: int = 0) -> None:
    """Experts split over device and mapped host memory (ds4/model/placement.py): the same row
    math through per-expert address tables, and a live member's picks counted for
    re-placement."""
    from ds4.kernels import placed

    k = cfg.num_experts_per_tok
    placed.moe_placed(t["experts.gate_up"], t["experts.down"], cfg.moe_intermediate_size,
                      r["idx"], r["wts"], r["h"], r["act"][:k], r["y"], cfg.swiglu_limit,
                      t["experts.counts"], live, member)
    if "mlp.shared_experts.gate_proj.weight" in t:
        _shared_expert(cfg, t, r)


def _shared_expert(cfg, t: dict, r: dict) -> None:
    """y += the shared expert of h (packed FP8, or bf16 words through ds4/kernels/moe)."""
    from ds4.kernels import packed

    gate, up, down = (t[f"mlp.shared_experts.{n}.weight"] for n in SHARED)
    sact = r["shared_act"]
    if not isinstance(gate, PackedMatrix):
        moe.moe_gate_up(gate, up, None, None, r["h"], sact, cfg.swiglu_limit)
        moe.moe_down(down, None, sact, r["y"], accumulate=True)
    elif gate.fmt == FP8:
        packed.moe_gate_up_fp8(gate.codes, gate.scale, up.codes, up.scale, gate.block[0],
                               None, None, r["h"], sact, cfg.swiglu_limit)
        packed.moe_down_fp8(down.codes, down.scale, down.block[0], None, sact, r["y"],
                            accumulate=True)
    else:
        packed.moe_gate_up_fp4(gate.codes, gate.scale, up.codes, up.scale, None, None,
                               r["h"], sact, cfg.swiglu_limit)
        packed.moe_down_fp4(down.codes, down.scale, None, sact, r["y"], accumulate=True)


def _scale_rows(m: PackedMatrix, rows: int) -> int:
    """Scale rows covering the first `rows` rows of m (FP8: whole tiles, FP4: one per row)."""
    return rows // m.block[0] if m.fmt == FP8 else rows
