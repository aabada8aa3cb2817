"""Rank 0 driving the others: the step message, the follower loop, keep-alives, a dying follower.

The graph here is a real function over the step's inputs with a real all-reduce in it, and the
ranks are real gloo processes on loopback: rank 0 sends steps (``StepSender``), rank 1 runs them
(``worker.follow``) with an empty cache interface (no cache tensors: the inputs are the step's).
"""

import os
import time
import traceback
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.multiprocessing as mp

from autodeploy.cache.interface import CachedSequenceInterface
from autodeploy.cache.sequence_info import build_sequence_info
from autodeploy.distributed import process_group
from autodeploy.runtime.state_snapshots import RESTORE, SAVE, Copy
from autodeploy.runtime.step_broadcast import FIELDS, StepSender, pack, payload_numel, state_copies, unpack
from autodeploy.utils.errors import RankFailure
from test_collectives import _free_port

ad = torch.ops.autodeploy

STEPS = [  # (tokens, start positions, page tables, all_logits)
    ([[5, 6, 7], [9]], [0, 4], [[1], [2, 3]], [True, False]),  # a prefill, then a decode
    ([[11], [12], [13]], [3, 5, 8], [[1], [2, 3], [4]], None),  # decodes only
    ([[1, 2, 3, 4, 5, 6]], [0], [[7, 8, 9]], None),  # one long prefill
]


def _info(i: int):
    tokens, starts, pages, all_logits = STEPS[i]
    return build_sequence_info(tokens, starts, pages, slots=list(range(len(tokens)))[::-1], all_logits=all_logits)


def _graph(*inputs: torch.Tensor) -> torch.Tensor:
    """Every rank's contribution summed: the input ids plus the rank, all-reduced."""
    return ad.torch_dist_all_reduce(inputs[0].float() + process_group.rank())


def test_a_step_survives_the_wire_format():
    for i in range(len(STEPS)):
        info = _info(i)
        header, payload = pack(info)
        assert header.tolist()[0] == 1 and payload.dtype == torch.long
        assert payload.numel() == payload_numel(header.tolist())
        back = unpack(header.tolist(), payload)
        for name in FIELDS:
            sent, got = getattr(info, name), getattr(back, name)
            assert got.dtype == sent.dtype and torch.equal(got, sent), name
    with pytest.raises(RankFailure, match="same autodeploy version"):
        unpack(header.tolist(), torch.cat([payload, payload[:1]]))


def test_state_copies_ride_with_a_step():
    info = _info(1)
    copies = [Copy(SAVE, 3, 0), Copy(RESTORE, 3, 2), Copy(SAVE, 0, 1)]
    header, payload = pack(info, copies)
    assert header.tolist()[-1] == 3 and payload.numel() == payload_numel(header.tolist())
    assert state_copies(header.tolist(), payload) == copies
    back = unpack(header.tolist(), payload)
    assert all(torch.equal(getattr(back, name), getattr(info, name)) for name in FIELDS)
    plain_header, plain = pack(info)
    assert state_copies(plain_header.tolist(), plain) == [] and payload.numel() == plain.numel() + 9


# ---- two ranks ----------------------------------------------------------------------------------
def _rank_main(rank: int, port: int, timeout_s: float, job: Callable[[int], Dict[str, Any]], results: Any) -> None:
    try:
        torch.set_num_threads(1)
        process_group.initialize(rank=rank, world_size=2, master_port=port, timeout_s=timeout_s)
        results.put((rank, job(rank)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        process_group.shutdown()


def _run(job: Callable[[int], Dict[str, Any]], timeout_s: float, wait_s: float = 60) -> List[Dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, timeout_s, job, results)) for r in range(2)]
    for p in procs:
        p.start()
    found: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    while len(found) < 2 and time.monotonic() < deadline:
        try:
            rank, value = results.get(timeout=1)
            found[rank] = value
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    found.setdefault(1, {"exitcode": procs[1].exitcode})
    assert 0 in found, "rank 0 reported nothing"
    return [found[0], found[1]]


def _cache() -> CachedSequenceInterface:
    return CachedSequenceInterface(page_size=4, max_batch_size=4, max_seq_len=32, max_num_tokens=16)


def _drive_job(rank: int) -> Dict[str, Any]:
    """Rank 0: three steps, idle for three times the group's timeout (keep-alives), three more, stop.
    Rank 1: follows, recording what it ran."""
    if rank == 1:
        seen: List[List[int]] = []

        def graph(*inputs: torch.Tensor) -> torch.Tensor:
            seen.append(inputs[0].reshape(-1).tolist() + inputs[9].tolist())  # input ids + logits rows
            return _graph(*inputs)

        from autodeploy.runtime.follower import follow

        return {"steps": follow(graph, _cache()), "seen": seen}
    sender = StepSender(torch.device("cpu"), keepalive_s=0.2)
    sums = []
    for phase in range(2):
        for i in range(len(STEPS)):
            info = _info(i)
            with sender.step(info):
                sums.append(_graph(*_cache().graph_args(info)).reshape(-1).tolist())
        if phase == 0:
            time.sleep(3 * process_group.timeout_s())  # longer than the timeout: only keep-alives bridge it
    assert sender.stop() and not sender.stop()  # once
    with pytest.raises(RankFailure, match="already told to stop"):
        with sender.step(_info(0)):
            pass
    return {"sums": sums, "steps": sender.steps, "failure": sender.failure}


@pytest.mark.slow  # ~10 s: the idle phase outlasts the group's timeout on purpose
@pytest.mark.distributed
def test_followers_run_every_step_rank_zero_sends_through_idle_time_until_stop():
    start = time.monotonic()
    driver, follower = _run(_drive_job, timeout_s=1.0)
    assert "error" not in driver, driver.get("error")
    assert "error" not in follower, follower.get("error")
    expected = [_info(i) for i in range(len(STEPS))] * 2
    assert follower["steps"] == driver["steps"] == 6 and driver["failure"] is None
    assert follower["seen"] == [e.input_ids.reshape(-1).tolist() + e.logits_index.tolist() for e in expected]
    # the all-reduce met on both ranks: ids + 0 on rank 0 plus ids + 1 on rank 1
    assert driver["sums"] == [(2 * e.input_ids.reshape(-1).float() + 1).tolist() for e in expected]
    assert time.monotonic() - start < 60


def _dying_follower_job(rank: int) -> Dict[str, Any]:
    if rank == 1:
        from autodeploy.runtime.step_broadcast import StepReceiver

        receiver = StepReceiver(torch.device("cpu"))
        for _ in range(2):
            _graph(*_cache().graph_args(receiver.receive().info))
        os._exit(3)  # dies without a word between steps
    sender = StepSender(torch.device("cpu"))
    heard: List[str] = []
    sender.on_failure.append(heard.append)
    start, steps = time.monotonic(), 0
    try:
        while time.monotonic() - start < 120:
            with sender.step(_info(steps % len(STEPS))):
                _graph(*_cache().graph_args(_info(steps % len(STEPS))))
            steps += 1
    except RankFailure as err:
        message = str(err)
    else:
        message = "no error"
    try:  # every later step fails at once with the same reason
        with sender.step(_info(0)):
            pass
        again = ""
    except RankFailure as err:
        again = str(err)
    return {"message": message, "again": again, "seconds": time.monotonic() - start, "steps": steps,
            "heard": heard, "stopped": sender.stop()}


@pytest.mark.distributed
def test_a_follower_that_dies_mid_run_fails_rank_zero_with_an_error_not_a_hang():
    driver, follower = _run(_dying_follower_job, timeout_s=20.0)
    assert "error" not in driver, driver.get("error")
    assert follower == {"exitcode": 3}
    assert driver["steps"] == 2 and driver["seconds"] < 30, driver
    assert "tensor parallelism across 2 ranks failed: step 2 failed on rank 0" in driver["message"]
    assert "check the other ranks' logs" in driver["message"]
    assert driver["again"] == driver["message"] and len(driver["heard"]) == 1
    assert driver["stopped"] is False  # no stop message after a failure


def _hanging_follower_job(rank: int) -> Dict[str, Any]:
    if rank == 1:
        from autodeploy.runtime.step_broadcast import StepReceiver

        receiver = StepReceiver(torch.device("cpu"))
        for _ in range(2):
            _graph(*_cache().graph_args(receiver.receive().info))
        time.sleep(4 * process_group.timeout_s())  # alive, but answers nothing
        os._exit(4)
    sender = StepSender(torch.device("cpu"))
    steps = 0
    try:
        while steps < 100:
            start = time.monotonic()
            with sender.step(_info(0)):
                _graph(*_cache().graph_args(_info(0)))
            steps += 1
    except RankFailure as err:
        return {"message": str(err), "seconds": time.monotonic() - start, "steps": steps}
    return {"message": "no error", "steps": steps}


@pytest.mark.slow  # ~10 s: waits out the group's timeout on purpose
@pytest.mark.distributed
def test_a_follower_that_hangs_fails_rank_zero_after_the_group_timeout():
    driver, follower = _run(_hanging_follower_job, timeout_s=2.0)
    assert "error" not in driver, driver.get("error")
    assert driver["steps"] == 2 and "tensor parallelism across 2 ranks failed: step 2 failed" in driver["message"]
    assert 1.5 < driver["seconds"] < 20, driver  # the group's timeout (2 s), not forever
    assert follower == {"exitcode": 4}
