"""The collective ops and the process group, on real gloo groups of separate processes.

One rank (no group): both ops are the identity and survive export and shape propagation. Two
ranks: all-reduce sums, all-gather concatenates in rank order, an exported graph with the ops
runs on each rank with shapes its fake kernels derived from the group, an RMSNorm over features
split across the ranks equals the whole norm, and a rank that dies makes the other fail with an
error instead of waiting forever.
"""

import os
import socket
import time
import traceback
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.multiprocessing as mp
from torch.export import Dim

from autodeploy.distributed import process_group
from autodeploy.utils.errors import ConfigError

ad = torch.ops.autodeploy


class Reduce(torch.nn.Module):
    def forward(self, x):
        return ad.torch_dist_all_gather(ad.torch_dist_all_reduce(x * 2), -1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank -----------------------------------------------------------------------------------
def test_one_rank_is_the_identity_and_survives_export():
    x = torch.randn(3, 5)
    reduced, gathered = ad.torch_dist_all_reduce(x), ad.torch_dist_all_gather(x, 0)
    assert torch.equal(reduced, x) and reduced.data_ptr() != x.data_ptr() and torch.equal(gathered, x)
    ep = torch.export.export(Reduce(), (x,), dynamic_shapes=({0: Dim.DYNAMIC},))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ad.torch_dist_all_reduce.default in targets and ad.torch_dist_all_gather.default in targets
    out_node = next(n for n in ep.graph.nodes if n.op == "output").args[0][0]
    assert out_node.meta["val"].shape[-1] == 5  # the fake kernel's shape: one rank, nothing gathered
    for rows in (1, 4):
        y = torch.randn(rows, 5)
        assert torch.equal(ep.module()(y), y * 2)


def test_environment_is_read_and_checked(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert process_group.environment() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK is missing"):
        process_group.environment()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="RANK 2 is not a rank of WORLD_SIZE 2"):
        process_group.environment()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    env = process_group.environment()
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 12345)
    with pytest.raises(ConfigError, match="rank 3 is not a rank of world_size 2"):
        process_group.initialize(rank=3, world_size=2)
    with pytest.raises(ConfigError, match="pass both rank and world_size"):
        process_group.initialize(rank=0)
    assert process_group.world_size() == 1 and process_group.rank() == 0 and not process_group.is_initialized()


# ---- two ranks ----------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, job: Callable[[int], Dict[str, Any]], results: Any) -> None:
    try:
        if os.environ.get("_AUTODEPLOY_NOOP_ACTIVE"):  # a no-op mutation run (tests/noop_mutation.py) reaches the ranks
            import noop_mutation

            noop_mutation.install(noop_mutation.parse_keys(os.environ["_AUTODEPLOY_NOOP_ACTIVE"]))
        torch.set_num_threads(1)
        process_group.initialize(rank=rank, world_size=world, master_port=port, timeout_s=20)
        # plain lists: a tensor sent through the queue lives in this process's shared memory,
        # which is gone if the process exits before the parent reads it
        results.put((rank, {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in job(rank).items()}))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        process_group.shutdown()


def _run_ranks(job: Callable[[int], Dict[str, Any]], world: int = 2, timeout: float = 120) -> List[Dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    found: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(found) < world and time.monotonic() < deadline:
        try:
            rank, value = results.get(timeout=1)
            found[rank] = value
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            if all(not p.is_alive() for p in procs):
                deadline = min(deadline, time.monotonic() + 5)  # all gone: drain what is left, then stop
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert len(found) == world, f"ranks {sorted(set(range(world)) - set(found))} reported nothing"
    return [found[r] for r in range(world)]


def _collectives_job(rank: int) -> Dict[str, Any]:
    x = torch.full((2, 3), float(rank + 1))
    x[0, 0] = 10.0 * (rank + 1)
    ep = torch.export.export(Reduce(), (torch.randn(2, 3),), dynamic_shapes=({0: Dim.DYNAMIC},))
    out_node = next(n for n in ep.graph.nodes if n.op == "output").args[0][0]
    return {
        "world": process_group.world_size(),
        "reduced": ad.torch_dist_all_reduce(x),
        "gathered0": ad.torch_dist_all_gather(x, 0),
        "gathered_last": ad.torch_dist_all_gather(x[:, :2], -1),
        "fake_width": out_node.meta["val"].shape[-1],
        "exported": ep.module()(torch.full((4, 3), float(rank))),
    }


@pytest.mark.distributed
def test_two_gloo_ranks_reduce_gather_and_run_an_exported_graph():
    for r in _run_ranks(_collectives_job):
        assert "error" not in r, r.get("error")
        r = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in r.items()}
        assert r["world"] == 2 and r["fake_width"] == 6  # the fake kernel saw the group of two
        assert torch.equal(r["reduced"], torch.tensor([[30.0, 3.0, 3.0], [3.0, 3.0, 3.0]]))
        expected0 = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
        expected0[0, 0], expected0[2, 0] = 10.0, 20.0
        assert torch.equal(r["gathered0"], expected0)
        assert torch.equal(r["gathered_last"], torch.cat([expected0[:2, :2], expected0[2:, :2]], dim=-1))
        # all_reduce(2x) over ranks holding 0 and 1 -> 2, then gathered twice along the last dim
        assert torch.equal(r["exported"], torch.full((4, 6), 2.0))


def _dist_rmsnorm_job(rank: int) -> Dict[str, Any]:
    """Every rank builds the same full ``x`` and weight; the norm runs on this rank's half of the
    features (split), and on all of them on both ranks (one slice held by every rank: the key norm
    of a key/value head replicated on the ranks)."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    half = slice(4 * rank, 4 * rank + 4)
    k, wk = torch.randn(2, 3, 4), torch.randn(4)
    pair = ad.torch_dist_rmsnorm_pair(x[..., half], w[half], 1e-6, k[..., 2 * rank:2 * rank + 2],
                                      wk[2 * rank:2 * rank + 2], 1e-5)
    return {"split": ad.torch_dist_rmsnorm(x[..., half], w[half], 1e-6).tolist(),
            "replicated": ad.torch_dist_rmsnorm(x, w, 1e-6).tolist(), "pair": [p.tolist() for p in pair]}


@pytest.mark.distributed
def test_norms_over_features_split_across_two_ranks_equal_the_whole_norms():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    k, wk = torch.randn(2, 3, 4), torch.randn(4)
    whole, key_whole = ad.torch_rmsnorm(x, w, 1e-6), ad.torch_rmsnorm(k, wk, 1e-5)
    assert torch.allclose(ad.torch_dist_rmsnorm(x, w, 1e-6), whole, atol=1e-6)  # one rank: the plain norm
    results = _run_ranks(_dist_rmsnorm_job)
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        assert torch.allclose(torch.tensor(r["split"]), whole[..., 4 * rank:4 * rank + 4], atol=1e-6)
        assert torch.allclose(torch.tensor(r["replicated"]), whole, atol=1e-6)
        # two norms, one all-reduce: each as its own norm over all its features
        assert torch.allclose(torch.tensor(r["pair"][0]), whole[..., 4 * rank:4 * rank + 4], atol=1e-6)
        assert torch.allclose(torch.tensor(r["pair"][1]), key_whole[..., 2 * rank:2 * rank + 2], atol=1e-6)
    # the half alone, normalised by its own squares, is a different answer: the sum over ranks matters
    assert not torch.allclose(ad.torch_rmsnorm(x[..., :4], w[:4], 1e-6), whole[..., :4], atol=1e-2)


def _dying_job(rank: int) -> Dict[str, Any]:
    if rank == 1:
        os._exit(3)  # dies without a word, in the middle of the run
    start = time.monotonic()
    try:
        ad.torch_dist_all_reduce(torch.ones(4))
    except Exception as err:  # noqa: BLE001 - what the survivor sees
        return {"raised": type(err).__name__, "seconds": time.monotonic() - start}
    return {"raised": None}


@pytest.mark.distributed
def test_a_dead_rank_is_an_error_for_the_others_not_a_hang():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, _dying_job, results)) for r in range(2)]
    for p in procs:
        p.start()
    rank, outcome = results.get(timeout=90)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert rank == 0 and "error" not in outcome, outcome
    assert outcome["raised"] is not None and outcome["seconds"] < 60
    assert procs[1].exitcode == 3
