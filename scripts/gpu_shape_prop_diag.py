"""Does shape propagation keep the graph symbolic on this machine's torch? ``python
scripts/gpu_shape_prop_diag.py [--device cuda|cpu]`` from the repository root.

Why it exists: on an H100/H200 with torch 2.11 (2026-11-26) some transforms were skipped with
"shape propagation failed (RuntimeError: Cannot call numel() on tensor with symbolic
sizes/strides)". The cause, found on 2026-11-28 by running the CPU suite under torch 2.11 (its CUDA
wheel, which runs on a machine without a GPU): the propagation ran composite ops through their C++
kernels, and 2.11's ``aten.matmul`` of an N-d by a 2-d tensor reads concrete sizes there (raising,
or specialising the sequence dim to the export's example length). ``run_shape_prop`` now runs
under the Python dispatcher, as torch.export does. This builds a float and an FP8 Llama and prints,
for each: the first node whose propagation raises (none expected), the transforms skipped because
propagation failed (none expected), and whether the input's batch and sequence dims are still
symbolic after the build (expected: yes).
"""
import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from autodeploy.transform import graph_utils as gu  # noqa: E402
from autodeploy.transform.interface import Stage  # noqa: E402
from helpers import build, family_checkpoint  # noqa: E402
import quant_checkpoints as qc  # noqa: E402

orig = gu._FakePropWithRealAttrs.run_node


def run_node(self, n):
    try:
        return orig(self, n)
    except Exception as exc:
        if not getattr(exc, "_seen", False):
            exc._seen = True
            print("FAILED NODE:", n.format_node()[:400])
            traceback.print_exc(limit=-6)
        raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    gu._FakePropWithRealAttrs.run_node = run_node
    print("torch", torch.__version__, "device", args.device)
    for label, ckpt, kw in (("float llama full", family_checkpoint("llama"), dict(compile_backend="torch-simple")),
                            ("fp8 llama post_load", qc.quantized_checkpoint("llama", "fp8"),
                             dict(up_to=Stage.POST_LOAD_FUSION))):
        print("=====", label)
        res = build(ckpt, device=args.device, dtype=dtype, max_seq_len=64, max_batch_size=2, **kw)
        skipped = [f"{r.key}: {r.error}" for r in res.context.history if "shape propagation failed" in (r.error or "")]
        print("skipped for shape propagation:", skipped or "none")
        gm = res.graph_module
        ids = next(n for n in gm.graph.nodes if n.op == "placeholder").meta.get("val")
        print("first input:", tuple(ids.shape) if ids is not None else None,
              "symbolic" if ids is not None and all(isinstance(d, torch.SymInt) for d in ids.shape) else "NOT symbolic")
        try:
            gu.run_shape_prop(gm, incremental=False)
            print("shape prop OK")
        except Exception as e:  # noqa: BLE001 - a diagnostic: print and go on
            print("shape prop error:", str(e).splitlines()[0][:200])


if __name__ == "__main__":
    main()
