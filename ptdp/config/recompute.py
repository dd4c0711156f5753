"""`train.recompute_modules`: what `train.recompute: selective` recomputes (models/recompute.py).

The names are Megatron-LM's `--recompute-modules` where it has them:

* `core_attn`: the core attention, softmax(QK^T)V (Korthikanti et al.'s selective recomputation).
  Worth it where the kernel keeps the s x s probabilities; a flash kernel (every kernel ptdp
  runs: CPU's fused kernel, CUDA's flash, memory-efficient and FlexAttention) keeps only its
  output and log-sum-exp, so re-running it costs an attention forward for s*b*h/t elements;
* `layernorm`: the two pre-norms; their outputs (the QKV and fc1 inputs, 2sbh) are rebuilt from
  the norms' inputs when backward needs them. With sequence parallelism the linears keep their
  all-gathered inputs instead, so it would save nothing: refused;
* `activation`: the dense MLP's (and shared experts') GeLU, SwiGLU or GeGLU, not the routed
  experts' (Megatron's `moe_act`); its output,
  fc2's input (sbf/t), is rebuilt from its input, which it keeps anyway;
* `mlp`: the whole dense MLP (fc1, activation, fc2 and fc2's all-reduce re-run in backward),
  keeping only its input. Not for models with experts (their layers have no dense MLP).

The default (`null`) recomputes the norms and the activation: cheap elementwise work that
saves 2sbh + sbf/t per layer and micro-batch, where the core attention would save sbh/t for a
whole attention forward. The planner (ptdp/planner/memory.py) models exactly these terms.
"""

from __future__ import annotations

RECOMPUTE_MODULES = ("core_attn", "layernorm", "activation", "mlp")


def selective_modules(modules, sequence_parallel: bool = False,
                      keeps_scores: bool = False) -> tuple[str, ...]:
    """The modules recompute=selective recomputes: `modules` (train.recompute_modules) when
    given, else the default: layernorm (not with sequence parallelism, where it saves nothing)
    and activation, plus core_attn where the attention kernel keeps its scores (`keeps_scores`:
    the planner's materialized attention, ptdp/planner/compute.py planned_modules)."""
    if modules is not None:
        return tuple(modules)
    default = ("activation",) if sequence_parallel else ("layernorm", "activation")
    return (("core_attn",) if keeps_scores else ()) + default


def check_recompute_modules(cfg, out) -> None:
    """One line per problem: the key with another recompute mode, an empty list, an unknown
    name, layernorm with sequence parallelism, mlp with experts."""
    modules = cfg.train.recompute_modules
    key = "train.recompute_modules"
    if modules is None:
        return
    if cfg.train.recompute != "selective":
        out.require(False, f"{key} is used only with train.recompute=selective (got "
                           f"{cfg.train.recompute}): remove it or set train.recompute=selective")
    elif not isinstance(modules, list) or not modules:
        out.require(False, f"{key} must be a non-empty list of {', '.join(RECOMPUTE_MODULES)} "
                           f"(got {modules!r}; to recompute nothing, train.recompute=none)")
    elif unknown := [m for m in modules if m not in RECOMPUTE_MODULES]:
        out.require(False, f"{key}: unknown module {unknown[0]!r}; choose from "
                           f"{', '.join(RECOMPUTE_MODULES)}")
    elif "layernorm" in modules and cfg.parallel.sequence_parallel:
        out.require(False, f"{key}: layernorm saves nothing with parallel.sequence_parallel "
                           f"(the linears keep their all-gathered inputs): remove it")
    elif "mlp" in modules and cfg.model.num_experts > 0:
        out.require(False, f"{key}: mlp recomputes the dense MLP, and a model with experts "
                           f"(model.num_experts) has MoE layers: use activation or layernorm")
