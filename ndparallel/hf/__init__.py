"""Hugging Face ``transformers`` models on ndparallel meshes (optional extra: ``pip install 'ndparallel[hf]'``).

``ndparallel.parallelize(hf_model, cfg, mesh)`` recognises a PreTrainedModel and applies the plans of
:mod:`ndparallel.plans.hf_tensor_parallel`; this package adds loading and saving of weights::

    from ndparallel.hf import load_pretrained, save_pretrained
    model = load_pretrained("path/to/folder", cfg, mesh)   # meta init, each rank reads its shards
    save_pretrained(model, "path/to/out")                 # full tensors gathered on rank 0
"""

from ndparallel.hf.pretrained import load_pretrained, local_region, save_pretrained

__all__ = ["load_pretrained", "local_region", "save_pretrained"]
