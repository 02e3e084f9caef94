"""Whether a Hugging Face model masks packed documents apart in one process, read from its own forward's source.

transformers 5 finds packed documents in ``position_ids`` inside its mask functions (``create_causal_mask`` and
its siblings), and only when the model passes ``position_ids`` to them. Most decoders do; a few build their masks
without them (gpt-oss, Bloom, MPT, XGLM, BioGPT, AFMoE, GraniteMoE-hybrid in 5.25), and in one process they
attend across packed documents, rotating each from position 0. ndparallel's attention would mask the documents
apart, so such a model's packed batches are refused under tp/cp instead of differing from one process.

The answer comes from the base model's ``forward`` source (its syntax tree): every call of a mask function must
name ``position_ids``, directly or through a keyword dict built in the same function (``mask_kwargs``, and its
``.copy()``). No mask function at all, or no source: nothing to compare with, taken as honoured.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

__all__ = ["ignores_packed_positions"]

_MASK_FUNCTIONS = frozenset(
    {
        "create_causal_mask",
        "create_sliding_window_causal_mask",
        "create_chunked_causal_mask",
        "create_masks_for_generate",
    }
)


def ignores_packed_positions(model: nn.Module) -> bool:
    """True when the model's base forward builds a mask without ``position_ids`` (packed documents unseen)."""
    prefix = getattr(model, "base_model_prefix", None) or "model"
    base = getattr(model, prefix, model)
    return _ignores(type(base))


@functools.cache
def _ignores(cls: type) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    dicts = _keyword_dicts(tree)
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and _name(call.func) in _MASK_FUNCTIONS:
            names = {k.arg for k in call.keywords if k.arg}
            names |= {key for k in call.keywords if k.arg is None for key in dicts.get(_name(k.value), set())}
            if "position_ids" not in names:
                return True
    return False


def _keyword_dicts(tree: ast.AST) -> dict[str, set[str]]:
    """``name -> keys`` of the dicts the function builds (``{...}`` literals, and ``other.copy()`` of one)."""
    dicts: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            continue
        value, target = node.value, node.targets[0].id
        if isinstance(value, ast.Dict):
            dicts[target] = {k.value for k in value.keys if isinstance(k, ast.Constant)}
        elif isinstance(value, ast.Call) and _name(value.func) == "copy" and isinstance(value.func, ast.Attribute):
            dicts[target] = set(dicts.get(_name(value.func.value), set()))
    return dicts


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None
