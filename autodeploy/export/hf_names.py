"""Graph parameter names that follow the checkpoint's, where transformers renames on load.

transformers 5 loads some checkpoints through a conversion mapping: renamings (Mixtral's
``block_sparse_moe`` is its module ``mlp``) and converters (per-expert weights stacked into one
tensor). ``save_pretrained`` reverts them, so checkpoints on disk carry the original names while
the modules, and therefore the exported graph, carry the new ones. Our loader reads tensors by
name; rather than teach it every mapping, the exported graph is given the checkpoint's names:
converters are handled where the experts are exported (``hf_moe``), renamings here, after export.
"""

from typing import Any, Collection, Dict, List, Optional

from torch import fx, nn

from ..utils.logging import get_logger

logger = get_logger(__name__)


def conversions(model: nn.Module) -> List[Any]:
    """transformers' weight conversions for ``model`` as ``save_pretrained`` uses them (no legacy
    renamings, no prefix changes); empty for models transformers has none for. A custom model
    (not a ``PreTrainedModel``) gets its ``config.model_type``'s mapping: it carries HF's module
    names, so the checkpoint on disk is named as for the HF class."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        if isinstance(model, PreTrainedModel):
            convs = get_model_conversion_mapping(model, add_legacy=False)
        else:  # a lean custom model keeps the HF module names: its type's root mapping applies as is
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            convs = (get_checkpoint_conversion_mapping(model_type) or []) if model_type else []
        return [c for c in convs if not isinstance(c, PrefixChange)]
    except Exception as exc:  # noqa: BLE001 - custom models, or a transformers without the mapping
        logger.debug("no weight conversion mapping for %s: %s", type(model).__name__, exc)
        return []


def reverted_renamings(convs: List[Any]) -> List[Any]:
    """The renamings ``save_pretrained`` applies to a module name to get the checkpoint name."""
    from transformers.core_model_loading import WeightRenaming

    return [c.reverse_transform() for c in convs[::-1] if isinstance(c, WeightRenaming)]


def checkpoint_name(name: str, renamings: List[Any]) -> str:
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(name, renamings) if renamings else name


def checkpoint_key(name: str, keys: Collection[str]) -> Optional[str]:
    """The checkpoint's key for ``name``: itself, or without / with the base-model prefix (as the
    loader finds it); None when the checkpoint has none."""
    if name in keys:
        return name
    _, _, tail = name.partition(".")
    if tail and tail in keys:
        return tail
    return f"model.{name}" if f"model.{name}" in keys else None


def in_checkpoint(name: str, keys: Collection[str]) -> bool:
    """``name`` is in the checkpoint, also without / with the base-model prefix (as the loader finds it)."""
    return checkpoint_key(name, keys) is not None


def rename_to_checkpoint(gm: fx.GraphModule, model: nn.Module, checkpoint_keys: Optional[Collection[str]]) -> int:
    """Rename the graph's parameters and buffers that transformers renamed on load back to their
    checkpoint names: those the checkpoint lacks and whose reverted name it has (nothing without
    ``checkpoint_keys``, so graphs of models without a checkpoint keep their module names).
    Returns the number renamed."""
    if checkpoint_keys is None:
        return 0
    renamings = reverted_renamings(conversions(model))
    if not renamings:
        return 0
    tensors = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    renames: Dict[str, str] = {}
    for name in tensors:
        new = checkpoint_name(name, renamings)
        if new == name:
            continue
        if in_checkpoint(name, checkpoint_keys) or not in_checkpoint(new, checkpoint_keys):
            continue
        renames[name] = new
    if not renames:
        return 0
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in renames:
            node.target = renames[str(node.target)]
    for old, new in renames.items():
        owner_path, _, leaf = old.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        is_param = leaf in owner._parameters
        tensor = owner._parameters.pop(leaf) if is_param else owner._buffers.pop(leaf)
        target = gm
        new_path, _, new_leaf = new.rpartition(".")
        for part in new_path.split(".") if new_path else []:
            child = target._modules.get(part)
            if child is None:
                child = nn.Module()
                target.add_module(part, child)
            target = child
        if is_param:
            target.register_parameter(new_leaf, tensor)
        else:
            target.register_buffer(new_leaf, tensor)
    gm.recompile()
    logger.info("renamed %d graph tensors to their checkpoint names (e.g. %s -> %s)", len(renames),
                *next(iter(renames.items())))
    return len(renames)
