"""Run autodeploy's own ops as plain Python calls in the ``torch-simple`` runner.

Every canonical and backend op is a ``torch.library.custom_op``, which is what lets
``torch.export``, shape propagation and ``torch.compile`` see it as one node with a fake
kernel. When the graph simply runs, though, each call still goes through the dispatcher's
layers around the Python kernel: autograd, the ``ADInplaceOrView`` version bump of mutated
arguments, the aliasing check, dynamo's disable wrapper. At inference none of them does
anything, and on CPU they are not free. Measured with torch 2.13 on the 2-core CI machine:
~9 us per call of a functional op and ~150 us per call of the 15-argument cached attention,
most of it in ``torch._library.utils.fill_defaults`` walking the schema. With 62 such calls
per decode step of a 12-layer model that is ~2.5 ms per step.

So the ``torch-simple`` backend runs a sibling of the graph whose autodeploy ops call their
Python kernels directly. The sibling shares every parameter and buffer with the graph, and the
graph itself keeps the ops (what ``autodeploy build``, the tests and the visualiser read).

Before (the graph)::

    attn = torch.ops.autodeploy.sdpa_cached_attention_with_cache.default(q, k, v, ...)

After (the sibling the runtime calls)::

    attn = autodeploy.ops.cached_attention.sdpa_cached_attention_with_cache(q, k, v, ...)  # the Python function

The sibling also reads its weights without ``nn.Module.__getattr__``: the graph's
``getattr(self.model.layers, "0").self_attn.o_proj.weight`` walks four module levels, each a
Python ``__getattr__`` that searches three dicts (~390 lookups per decode step of the 12-layer
``small`` preset). Each ``get_attr`` of the sibling names a flat attribute (``_weight_<n>``) set
in its instance ``__dict__``, holding the same tensor object as the module tree: one dict hit,
no copy. Parameters swapped for new objects after the sibling is built would not be seen; the
runtime only changes weights in place.
"""

from typing import Any, Callable, Optional, Tuple

import torch
from torch import fx
from torch._library import custom_ops

from ..utils.fx import copy_graph_module, get_attr_value
from ..utils.logging import get_logger

logger = get_logger(__name__)

NAMESPACE = "autodeploy"


def python_kernel(target: Any, device_type: str) -> Optional[Callable[..., Any]]:
    """The Python function the dispatcher would end up calling for ``target`` on
    ``device_type``, or None when ``target`` is not an autodeploy custom op (aten ops, and ops
    registered some other way, keep their dispatch)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE:
        return None
    # torch's custom-op registry is private: should it change, every op keeps its dispatch
    opdef = getattr(custom_ops, "OPDEFS", {}).get(target._schema.name)
    kernels = getattr(opdef, "_backend_fns", None)
    if not isinstance(kernels, dict):
        return None
    if device_type in kernels:
        return kernels[device_type]
    if None in kernels:  # the kernel for every device, given where the op was defined
        return getattr(opdef, "_init_fn", None)
    return None


def direct_kernel_graph(gm: fx.GraphModule, device_type: str) -> Tuple[fx.GraphModule, int]:
    """A sibling of ``gm`` (same parameters, copied graph) whose autodeploy ops call their
    Python kernels directly; returns it and the number of calls rewritten."""
    sibling = copy_graph_module(gm)
    swapped = 0
    flat: dict = {}  # get_attr target -> flat attribute name
    for node in sibling.graph.nodes:
        if node.op == "get_attr":
            target = str(node.target)
            if target not in flat:
                flat[target] = f"_weight_{len(flat)}"
                sibling.__dict__[flat[target]] = get_attr_value(sibling, node)
            node.target = flat[target]
            continue
        if node.op != "call_function":
            continue
        kernel = python_kernel(node.target, device_type)
        if kernel is not None:
            node.target = kernel
            swapped += 1
    sibling.recompile()
    logger.debug("direct kernels: %d autodeploy op calls run without the dispatcher", swapped)
    return sibling, swapped
