"""Write a graph for people to read: Graphviz DOT (rendered to SVG when ``dot`` is installed)
plus the generated Python code and a one-line-per-node listing."""

import os
import shutil
import subprocess
from typing import List

from torch import fx

from ..utils.logging import get_logger

logger = get_logger(__name__)


def _label(node: fx.Node) -> str:
    target = node.target if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
    val = node.meta.get("val")
    shape = ""
    if hasattr(val, "shape"):
        shape = "\\n" + "x".join(str(d) for d in val.shape) + f" {str(val.dtype).replace('torch.', '')}"
    return f"{node.name}\\n{node.op}: {target}{shape}".replace('"', "'")


def graph_to_dot(gm: fx.GraphModule) -> str:
    lines: List[str] = ["digraph G {", '  node [shape=box, fontname="monospace", fontsize=9];']
    for node in gm.graph.nodes:
        color = {"placeholder": "lightblue", "get_attr": "lightgrey", "output": "palegreen"}.get(node.op)
        style = f', style=filled, fillcolor="{color}"' if color else ""
        lines.append(f'  "{node.name}" [label="{_label(node)}"{style}];')
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            lines.append(f'  "{inp.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def write_graph(gm: fx.GraphModule, path_prefix: str) -> List[str]:
    """Write ``<prefix>.dot``, ``<prefix>.txt`` (and ``<prefix>.svg`` if Graphviz is present)."""
    os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
    written = []
    dot_path = path_prefix + ".dot"
    with open(dot_path, "w") as f:
        f.write(graph_to_dot(gm))
    written.append(dot_path)
    txt_path = path_prefix + ".txt"
    with open(txt_path, "w") as f:
        for node in gm.graph.nodes:
            f.write(node.format_node() + "\n")
        f.write("\n# generated code\n" + gm.code)
    written.append(txt_path)
    if shutil.which("dot"):
        svg_path = path_prefix + ".svg"
        try:
            subprocess.run(["dot", "-Tsvg", dot_path, "-o", svg_path], check=True, timeout=120)
            written.append(svg_path)
        except (subprocess.SubprocessError, OSError) as exc:
            logger.warning("graphviz could not render %s: %s", dot_path, exc)
    logger.info("wrote graph visualisation: %s", ", ".join(written))
    return written
