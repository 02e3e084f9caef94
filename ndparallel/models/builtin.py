"""The built-in model families, registered with the family lookup when this module is imported.

``ndparallel``'s ``__init__`` hands the import of this module to
:func:`~ndparallel.parallel.protocol.load_builtin_families_with`, so the families (and the DTensor styles they
import) load at the first family lookup, not with ``ndparallel.models``: the ``ndparallel train`` front process
reads a model's shape without them (docs/architecture.md, "Adding a model family").
"""

from ndparallel.models.hf.family import FAMILY as _HF_FAMILY
from ndparallel.models.transformer.family import FAMILY as _TRANSFORMER_FAMILY
from ndparallel.parallel.protocol import register_builtin_family

register_builtin_family(_HF_FAMILY)
register_builtin_family(_TRANSFORMER_FAMILY, default=True)  # a model no family claims gets the reference answers
