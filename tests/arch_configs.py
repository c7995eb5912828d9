"""Tiny HF configs of decoder families beyond tests/tiny_configs.py (hidden 64, 2-3 layers, vocab 512), each with
the features that set its family apart switched on. Shared by tests/estimate/test_arch_matrix.py and bench/arch_matrix.py;
copy before mutating."""

_COMMON = dict(hidden_size=64, num_attention_heads=4, vocab_size=512, max_position_embeddings=1024)

ARCH_CONFIGS = {
    # OPT: learned positions (offset 2), pre-LN, ReLU MLP, a word_embed_proj_dim that equals hidden (no projection)
    "opt": dict(_COMMON, model_type="opt", ffn_dim=128, num_hidden_layers=2, word_embed_proj_dim=64,
                do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0),
    # Falcon-7B layout: multi-query attention (one K/V head), parallel attention + MLP off one LayerNorm, rotary
    "falcon": dict(_COMMON, model_type="falcon", num_hidden_layers=2, multi_query=True, parallel_attn=True,
                   new_decoder_architecture=False, alibi=False, bias=False, hidden_dropout=0.0,
                   attention_dropout=0.0),
    # GPT-J: partial rotary (rotary_dim of head_dim 16), parallel residual, one LayerNorm per block
    "gptj": dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=1024, rotary_dim=8,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    # StableLM: partial rotary (25%), LayerNorm, gated SiLU MLP, grouped K/V
    "stablelm": dict(_COMMON, model_type="stablelm", intermediate_size=128, num_hidden_layers=2,
                     num_key_value_heads=2, partial_rotary_factor=0.25),
    # Phi-1 / Phi-2: partial rotary (50%), parallel attention + MLP off one LayerNorm, GELU MLP, dense
    "phi": dict(_COMMON, model_type="phi", intermediate_size=256, num_hidden_layers=2, num_key_value_heads=4,
                partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    # Qwen3: q/k RMSNorm per head, an explicit head_dim, grouped K/V
    "qwen3": dict(_COMMON, model_type="qwen3", intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                  head_dim=16),
    # Gemma 3: sandwich norms (4 per block), q/k norm, sliding-window layers beside a global one, GELU-tanh gated
    # MLP, scaled embeddings, tied head
    "gemma3_text": dict(_COMMON, model_type="gemma3_text", intermediate_size=128, num_hidden_layers=2,
                        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]),
    # Mixtral: top-2 of 4 routed SwiGLU experts
    "mixtral": dict(_COMMON, model_type="mixtral", intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2),
    # Qwen2-MoE: top-2 of 4 routed experts plus a gated shared expert
    "qwen2_moe": dict(_COMMON, model_type="qwen2_moe", intermediate_size=128, num_hidden_layers=2,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96),
    # DeepSeek-V2: multi-head latent attention (low-rank q and kv, decoupled rotary part), a dense first block,
    # then top-2 of 4 routed experts plus 1 shared expert
    "deepseek_v2": dict(_COMMON, model_type="deepseek_v2", intermediate_size=128, num_hidden_layers=3,
                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=48, first_k_dense_replace=1,
                        topk_method="greedy", n_group=1, topk_group=1),
    # OLMoE: q/k norm over the whole projection, top-2 of 8 experts
    "olmoe": dict(_COMMON, model_type="olmoe", intermediate_size=48, num_hidden_layers=2, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=2),
    # gpt-oss: attention sinks, alternating sliding / full layers, top-2 of 4 experts with clamped SwiGLU
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"]),
}
