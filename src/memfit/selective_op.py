"""The selective-op checkpointing policy as source text: the one definition that memfit runs (memfit._torch.blocks
compiles it) and that the FSDP2 script memfit emits writes (memfit.emit.fsdp via memfit.techniques.checkpointing).
It imports nothing, so the torch side that runs it and the technique that owns it both sit above it."""

SELECTIVE_OP_POLICY = '''def selective_op_context():
    """selective-op (torchtitan's op-level SAC policy): per checkpointed call, keep the outputs of the 1st, 3rd, ...
    matmul (mm / addmm) and of the SDPA kernels; recompute every other op (norms, activations, rotary, casts)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default}
    kernels = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name)}
    seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            seen[ctx.is_recompute] += 1
            keep = seen[ctx.is_recompute] % 2 == 1
        else:
            keep = func in kernels
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)'''
"""selective-op's one definition: torchtitan's op-level SAC policy (torchtitan/distributed/activation_checkpoint.py)
with aten.addmm counted as a matmul and the CPU flash kernel beside the CUDA ones (memfit._torch.blocks). It is
source text because it is both what memfit runs (memfit._torch.blocks.selective_op_context compiles it) and what
the FSDP2 script memfit emits writes (memfit.emit.fsdp), byte for byte; it reads `torch` from its globals."""
