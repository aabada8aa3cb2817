#!/usr/bin/env python
"""Weight memory per rank at world size 1, 2 and 4 (tensor + expert parallelism, ``detect_sharding``).

    python benchmarks/bench_tp_memory.py [--model small] [--worlds 1,2,4]
    python benchmarks/bench_tp_memory.py --smoke        # tiny-llama at 1 and 2 ranks, no files

Each world size starts that many gloo ranks on this machine (``torch.multiprocessing`` spawn,
loopback rendezvous); every rank builds its shard up to ``weight_load`` (what ``load_weights``
read from the memory-mapped safetensors: only this rank's slices) and reports the bytes of the
tensors its graph holds (each storage once), split into the sharded weights (``ctx.weight_shards``)
and what stays whole on every rank (norms, an embedding with ``shard_embedding`` off, projections
the plan replicates). The baseline is HF's own module from the same checkpoint (``from_pretrained``,
float32): what one process holds without autodeploy. Memory is counted, not timed, so the numbers
do not depend on the load of the machine. Writes ``benchmarks/results/tp-memory-<model>-<time>.json``
and ``.md``.
"""

import argparse
import json
import logging
import os
import sys
from datetime import datetime
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_ranks  # noqa: E402

logger = logging.getLogger("bench_tp_memory")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 2**20


def _checkpoint(model: str) -> str:
    from autodeploy.models.presets import PRESETS, preset_dir

    return preset_dir(model) if model in PRESETS else model


def _bytes(named: Dict[str, torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in named.values():
        if t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.numel() * t.element_size()
    return total


def _measure(model: str, world: int) -> Dict[str, Any]:
    """This rank's shard built up to weight_load: bytes held, sharded and whole."""
    from autodeploy.config import load_deploy_config
    from autodeploy.pipeline import build_graph
    from autodeploy.transform.interface import Stage
    from autodeploy.transform.optimizer import build_transform

    cfg = load_deploy_config(model=_checkpoint(model), world_size=world, dtype="float32")
    transforms = {k: ({**(v or {}), "enabled": False} if build_transform(k, v).config.stage.order > Stage.WEIGHT_LOAD.order
                      else v) for k, v in cfg.transforms.items()}
    result = build_graph(cfg.model_copy(update={"transforms": transforms}), log_summary=False)
    gm = result.graph_module
    tensors = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    sharded = {n: t for n, t in tensors.items() if n in result.context.weight_shards}
    whole = {n: t for n, t in tensors.items() if n not in result.context.weight_shards}
    return {"total": _bytes(tensors), "sharded": _bytes(sharded), "whole": _bytes(whole),
            "sharded_tensors": len(sharded)}


def _rank_main(rank: int, port: int, world: int, model: str, queue: Any) -> None:
    from autodeploy.distributed import process_group

    try:
        torch.set_num_threads(1)
        if world > 1:
            process_group.initialize(rank=rank, world_size=world, master_port=port, timeout_s=300)
        queue.put((rank, _measure(model, world)))
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        queue.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        if world > 1:
            process_group.shutdown()


def _run(model: str, world: int) -> List[Dict[str, Any]]:
    results = run_ranks(_rank_main, world, (world, model))
    return [results[r] for r in range(world)]


def _hf_bytes(model: str) -> int:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(_checkpoint(model), dtype=torch.float32)
    return _bytes({**dict(hf.named_parameters()), **dict(hf.named_buffers())})


def _table(rows: List[Dict[str, Any]], hf: int) -> str:
    lines = [f"| world size | per rank MiB (max over ranks) | sharded MiB | whole on every rank MiB | vs HF module "
             f"({hf / MiB:.1f} MiB) | all ranks MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['per_rank'] / MiB:.1f} | {r['sharded'] / MiB:.1f} | {r['whole'] / MiB:.1f} | "
                     f"{r['per_rank'] / hf:.2f}x | {r['all_ranks'] / MiB:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="preset name or checkpoint directory")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama at world sizes 1 and 2, no files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        args.model, args.worlds = "tiny-llama", "1,2"
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        ranks = _run(args.model, world)
        rows.append({"world": world, "per_rank": max(r["total"] for r in ranks),
                     "sharded": max(r["sharded"] for r in ranks), "whole": max(r["whole"] for r in ranks),
                     "all_ranks": sum(r["total"] for r in ranks), "ranks": ranks})
    hf = _hf_bytes(args.model)
    table = _table(rows, hf)
    logger.info("torch %s, model %s, float32, weights after load_weights\n%s", torch.__version__, args.model, table)
    if args.smoke:
        return
    os.makedirs(RESULTS, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.model))  # a preset, or a checkpoint directory's name
    stem = os.path.join(RESULTS, f"tp-memory-{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": {"model": args.model, "torch": torch.__version__, "hf_bytes": hf}, "rows": rows}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    logger.info("wrote %s.json and .md", stem)


if __name__ == "__main__":
    main()
