"""The planners and their order: each knows a :class:`~ndparallel.distributed.mesh.Mesh` and a model family
(:class:`~ndparallel.parallel.protocol.FamilyProtocol`), never a model class (docs/architecture.md).

``protocol`` (what a model family answers, planner-free, and the lookup
:func:`~ndparallel.parallel.protocol.family_for` that planners and jobs use), ``family``
(:class:`~ndparallel.parallel.family.ModelFamily`: the protocol with the planners' default attention and MoE
handling, the class a family subclasses), ``parallelize`` (the one order: TP/SP -> CP -> MoE/EP -> activation
checkpointing -> compile -> FSDP2/HSDP/replicate), one module per planner (``tensor_parallel``,
``context_parallel``, ``expert_parallel``, ``moe_tensor_parallel``, ``activation_checkpoint``, ``compile``,
``fully_shard``, ``replicate``), ``master_weights`` (fp32 masters of low-precision parameters, as Accelerate keeps
them), ``fqn`` (module-path patterns), ``masks`` (padding and packed documents as one document mask),
``grad_sync``, ``clip``, ``loss``, and ``pipeline/``. tests/test_architecture.py holds that this list names every
module here.
"""
