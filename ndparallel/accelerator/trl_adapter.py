"""TRL's trainers on ndparallel: what TRL computes itself, made exact on the mesh or refused by name.

``SFTTrainer`` computes its loss and metrics from the hidden states, through a *fused LM head* it patches onto
the model (``model(..., fused_lm_head=True)``: the backbone, then ``lm_head.weight`` in tiles, per-token
log-probabilities, entropy and top-1 hits). On ndparallel:

* **tp**: the backbone's last hidden state is a sequence shard (sequence parallel: the final norm's output
  stays local), while TRL pairs it with the whole row's labels. :func:`gather_fused_head_input` gathers it over
  ``tp`` for fused calls only (TRL gathers the DTensor ``lm_head.weight`` itself). Every tp rank then computes
  the same loss; the gather's backward hands each rank its positions' gradient, so the gradient is one
  process's.
* **cp**: the Trainer shards ``input_ids``, ``shift_labels`` and ``position_ids`` alike, so each rank's fused
  log-probabilities are exact for its positions; the loss is ``sum / num_items_in_batch`` times ``dp x cp`` (the
  Trainer's convention), which ndparallel's mixin leaves as it is. TRL's token-accuracy, entropy and token
  counts are per-rank sums, gathered over ``dp_cp`` (``TrainerAccelerator.shares_of_the_batch``).
* TRL divides its gathered token count by tp (Accelerate gathers over the world); ndparallel's gather counts
  each sample once, so the divisor is set to 1.
* under pp TRL's ``compute_loss`` does not run: the pipeline's last stage computes the labels' cross entropy
  (TRL's ``loss_type="nll"``; another loss type is refused), and TRL's metrics are not logged; TRL's packing and
  padding-free batches (one flattened row, which the pipeline cannot split into micro-batches) are refused;
* refused: an MoE's router aux loss on several data ranks or under pp (TRL adds the rank's own batch's aux
  loss, not the global batch's), and ``DPOTrainer`` / other TRL trainers under tp, cp or pp (their
  ``compute_loss`` is theirs: :func:`ndparallel.accelerator.trainer_checks.refuse_shard_blind_losses`).

docs/fine-tuning.md.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ndparallel.errors import ConfigError

__all__ = ["adapt_trl_trainer", "gather_fused_head_input"]

_ADAPTED = "_ndp_fused_head_gathered"


def _gather_last_hidden(mesh: DeviceMesh, _module: nn.Module, _args: Any, output: Any) -> Any:
    """The backbone's ``last_hidden_state`` from sequence shards over ``mesh`` (tp) to the whole local rows."""
    hidden = output.last_hidden_state
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, (Shard(1),), run_check=False)
    output.last_hidden_state = hidden.full_tensor()
    return output


def gather_fused_head_input(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Wrap the fused-LM-head forward TRL patched onto ``model`` (an instance attribute): with
    ``fused_lm_head=True`` the backbone's output is gathered over ``tp_mesh`` first. Other calls are untouched."""
    forward = vars(model).get("forward")
    if forward is None or getattr(forward, _ADAPTED, False):
        return

    @functools.wraps(forward)
    def fused_head_on_whole_rows(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return forward(*args, **kwargs)
        hook = model.base_model.register_forward_hook(functools.partial(_gather_last_hidden, tp_mesh))
        try:
            return forward(*args, fused_lm_head=True, **kwargs)
        finally:
            hook.remove()

    setattr(fused_head_on_whole_rows, _ADAPTED, True)
    model.forward = fused_head_on_whole_rows


def _is_trl(trainer: Any) -> bool:
    return any(cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def adapt_trl_trainer(trainer: Any, mesh: Any) -> None:
    """After a TRL trainer's ``__init__``: the fused head under tp, TRL's token-count divisor, the refusals."""
    if not _is_trl(trainer):
        return
    pp = trainer.accelerator.parallelism_config.pp_size
    loss_type = getattr(trainer.args, "loss_type", "nll")
    if pp > 1 and loss_type != "nll":
        raise ConfigError(
            f"{type(trainer).__name__}(loss_type={loss_type!r}) under pp_size={pp}: the pipeline's last stage computes "
            "the cross entropy of the labels (TRL's 'nll') inside torch's schedule; use loss_type='nll', or pp_size=1"
        )
    flattened = [name for name in ("packing", "padding_free") if getattr(trainer.args, name, False)]
    if pp > 1 and flattened:
        raise ConfigError(
            f"{type(trainer).__name__}({flattened[0]}=True) under pp_size={pp}: TRL flattens each batch into one row, "
            "which the pipeline cannot split into micro-batches; pad rows to one length (pad_to_multiple_of="
            "max_length; padding is masked exactly), or train packed data with pp_size=1"
        )
    if getattr(trainer, "aux_loss_enabled", False) and (mesh.size("dp_cp") > 1 or pp > 1):
        raise ConfigError(
            f"{type(trainer).__name__} adds each rank's own router aux loss (its local batch's), which on "
            f"dp x cp = {mesh.size('dp_cp')} ranks, pp_size={pp}, is not one process's: set router_aux_loss_coef=0.0, "
            "or train the MoE with ndparallel.hf.Trainer (the model's aux loss is the global batch's)"
        )
    if hasattr(trainer, "_tp_size"):
        trainer._tp_size = 1  # TRL's token-count divisor: ndparallel's gather_for_metrics counts each sample once
    if mesh.size("tp") > 1:
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        gather_fused_head_input(model, mesh["tp"])
