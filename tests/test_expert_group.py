"""Expert parallel (Engine.open(gpus=N), ds4/model/expert_group.py) on CPU: the ranks are
threads exchanging host arrays, the NumPy twin of the NCCL group. Split over 2 and 3 ranks,
the tiny model and the tiny model as a packed FP8 + FP4 checkpoint give one engine's greedy
tokens, with logits within 1e-5 of their scale (the ranks' partial sums add in another order;
measured 5.7e-6 absolute on logits of magnitude ~3); one rank gives them bitwise. Prefill
runs in several chunks, then single steps and a batched step; the kernel decoder (through its
NumPy twins) runs its own side of the group: the wire, the local picks, the all-reduce."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_batch_engine import packed_tiny, prompt
from test_gpu_decode_twins import row_twins, twins  # noqa: F401 (fixtures)

from ds4.engine import Engine, default_model_dir
from ds4.model.expert_group import HostComm, HostExchange, local_maps, owned, owner_table
from ds4.model.graph_decode import GraphDecode

TOL = 1e-5


@pytest.fixture(scope="module", params=["tiny", "tiny-packed"])
def model_dir(request, tmp_path_factory):
    if request.param == "tiny":
        return default_model_dir()
    return packed_tiny(tmp_path_factory.mktemp("official"))


def greedy(engine: Engine, lengths=(40, 23), steps: int = 6):
    """(tokens, logits) of greedy decoding for sessions of these prompt lengths: single
    steps first, then batched steps of all of them."""
    sessions = [engine.new_session(256) for _ in lengths]
    for s, n in zip(sessions, lengths):
        s.sync(prompt(n, n))
    tokens, logits = [], []
    for _ in range(steps):
        for s in sessions:
            tokens.append(int(np.argmax(s.logits)))
            logits.append(s.logits.copy())
            s.decode(tokens[-1])
    for _ in range(steps):
        picks = [int(np.argmax(s.logits)) for s in sessions]
        tokens += picks
        logits += [row.copy() for row in engine.decode_batch(sessions, picks)]
    return tokens, np.array(logits)


def opened(model_dir, **kw) -> Engine:
    return Engine.open(model_dir, backend="numpy", prefill_chunk=16, **kw)


@pytest.fixture(scope="module")
def reference(model_dir):
    e = opened(model_dir)
    yield greedy(e), e.memory_report()
    e.close()


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_split_experts_give_one_engines_tokens(model_dir, reference, gpus):
    (want, ref), report = reference
    e = opened(model_dir, gpus=gpus)
    try:
        got, logits = greedy(e)
        assert got == want
        if gpus == 1:
            assert np.array_equal(logits, ref)
        assert np.abs(logits - ref).max() <= TOL * np.abs(ref).max()
        split = e.memory_report()
        assert split["weight_bytes"] == report["weight_bytes"]
        assert split["gpus"] == gpus and len(split["expert_bytes_per_gpu"]) == gpus
    finally:
        e.close()


def test_an_owner_table_places_experts_where_it_says(model_dir, reference):
    (want, _), _ = reference
    cfg = opened(model_dir).config
    table = np.zeros(cfg.n_routed_experts, dtype=int)
    table[:3] = 1  # rank 1 holds three experts, rank 0 the rest
    e = opened(model_dir, gpus=2, expert_owners=table)
    try:
        assert greedy(e)[0] == want
        per_gpu = e.memory_report()["expert_bytes_per_gpu"]
        assert per_gpu[1] * (cfg.n_routed_experts - 3) == per_gpu[0] * 3
    finally:
        e.close()


def test_the_decode_graphs_group_side_gives_the_same_tokens(row_twins):  # noqa: F811
    """The kernel decoder's MoE over the group (rank 0's router writing into the wire, every
    rank's rows_moe over its local picks, the all-reduce) equals the one-GPU kernel decoder:
    bitwise on one rank, within 5e-5 of the logits' scale on two (measured 1.2e-5: the ranks'
    sums add in another order, and the twins split x into bf16 hi + lo per batch)."""
    runs = []
    for gpus in (None, 1, 2):
        e = opened(default_model_dir(), gpus=gpus)
        e.model.kernel_decoder = GraphDecode(e.model)  # one-token steps: the twin decoder
        e.model.batch_rows = False  # batched steps too
        try:
            runs.append(greedy(e, steps=4))
            assert (e.model.kernel_decoder.decoder.shard is None) == (gpus is None)
        finally:
            e.close()
    (want, ref), (one, one_logits), (two, two_logits) = runs
    assert one == want and two == want and np.array_equal(one_logits, ref)
    assert np.abs(two_logits - ref).max() <= 5 * TOL * np.abs(ref).max()


def test_default_owners_are_expert_mod_n_and_maps_index_each_ranks_share():
    owners = owner_table(2, 7, 3)
    assert owners.tolist() == [[0, 1, 2, 0, 1, 2, 0]] * 2
    assert owned(owners, 1) == [[1, 4], [1, 4]]
    assert local_maps(owners, 0)[0].tolist() == [0, -1, -1, 1, -1, -1, 2]
    assert local_maps(owners, 2)[1].tolist() == [-1, -1, 0, -1, -1, 1, -1]


@pytest.mark.parametrize("table, message", [([0, 1, 2], "ranks 0..1"), ([0, 0, 0], "each")])
def test_bad_owner_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        owner_table(1, 3, 2, table)


def test_bad_gpu_counts_are_refused():
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        Engine.open(default_model_dir(), backend="numpy", gpus=0)
    experts = opened(default_model_dir()).config.n_routed_experts
    with pytest.raises(ValueError, match="at least one expert"):
        Engine.open(default_model_dir(), backend="numpy", gpus=experts + 1)


def test_host_ranks_broadcast_rank_0_and_sum_in_rank_order():
    exchange, n = HostExchange(3, timeout=30), 3
    bufs = [np.full(4, r + 1, np.float32) for r in range(n)]
    sums = [np.arange(4, dtype=np.float32) * (r + 1) for r in range(n)]

    def rank(r):
        comm = HostComm(exchange, r)
        comm.broadcast(bufs[r])
        comm.all_reduce(sums[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(b, np.ones(4)) for b in bufs)
    assert all(np.array_equal(s, np.arange(4) * 6.0) for s in sums)


def no_comm():
    """A worker's communicator where no collective runs (the spawn test below)."""
    return None


def test_a_spawned_worker_loads_its_share_and_stops(model_dir, reference):
    """The process a GPU group starts per extra GPU (here on NumPy, no NCCL): a fresh
    interpreter loads its experts from the model directory, reports their bytes (rank 1's
    share of e mod 2), and exits when told to stop."""
    from ds4.model.expert_worker import ShardSource, spawn_worker

    e = opened(model_dir, gpus=2)
    want = e.memory_report()["expert_bytes_per_gpu"][1]
    e.close()
    owners = owner_table(e.config.num_hidden_layers, e.config.n_routed_experts, 2)
    link, proc = spawn_worker(ShardSource(str(model_dir), "auto", 0), owners, 1, no_comm,
                              backend="numpy")
    try:
        assert link.poll(120) and link.recv() == ("ready", want)
        link.send(("stop",))
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.terminate()


def test_a_step_after_a_worker_exited_fails_clearly_instead_of_waiting():
    e = opened(default_model_dir(), gpus=2)
    s = e.new_session(64)
    s.sync([0, 5, 9, 13])
    e.group.links[0].send(("stop",))  # the worker leaves, as if it had crashed
    e.group.workers[0].join(30)
    with pytest.raises(RuntimeError, match="expert worker of GPU 1 has exited"):
        s.decode(int(np.argmax(s.logits)))
    e.close()


def test_health_is_503_saying_why_once_an_expert_worker_has_exited():
    """A server whose group lost a worker says so on /health (an orchestrator restarts it),
    and a new request gets a 503 in its protocol's shape saying why, not a hang."""
    import httpx
    from test_server_support import live_server

    with live_server(backend="numpy", gpus=2) as (url, runtime):
        assert httpx.get(url + "/health").status_code == 200
        group = runtime.engine.group
        group.links[0].send(("stop",))
        group.workers[0].join(30)
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert "expert worker of GPU 1 has exited" in health.json()["error"]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "deepseek-v4-flash", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        assert "expert worker of GPU 1" in r.json()["error"]["message"]


@pytest.mark.parametrize("table", [[0, 1], [[0, 1, 0]], [0.5, 1, 0]])
def test_owner_tables_of_the_wrong_shape_or_type_are_refused(table):
    with pytest.raises(ValueError, match="one per expert"):
        owner_table(2, 3, 2, table)


def test_the_servers_owner_table_reaches_the_group():
    """ds4-server's --expert-owners table (ServerConfig.expert_owners) places the experts."""
    from test_server_support import live_server

    e = opened(default_model_dir())
    E = e.config.n_routed_experts
    e.close()
    table = [1] * 2 + [0] * (E - 2)
    with live_server(backend="numpy", gpus=2, expert_owners=table) as (_, runtime):
        per_gpu = runtime.engine.memory_report()["expert_bytes_per_gpu"]
        assert per_gpu[0] * 2 == per_gpu[1] * (E - 2)
