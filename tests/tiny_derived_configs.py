"""Tiny HF configs of families memfit sizes by derived formulas (memfit.derive: a graph for the parameters, the
activations fitted from traces of 1- and 2-block copies): hidden 64, 2 layers, 4 heads, vocab 512, as
tiny_configs.py. Kept apart from TINY_CONFIGS, which conftest parametrizes every family test over."""

DERIVED_CONFIGS = {
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 512, "word_embed_proj_dim": 64},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 512},
    "gptj": {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "rotary_dim": 8,
             "vocab_size": 512, "n_positions": 512, "bos_token_id": 0, "eos_token_id": 0},
    "stablelm": {"model_type": "stablelm", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
                 "max_position_embeddings": 512},
    "phi": {"model_type": "phi", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 512},
    # MoE: memfit's MoE recipe sizes full fine-tunes; LoRA on it stays with memfit.derive (estimate.moe.applies)
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                "max_position_embeddings": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
                "sliding_window": None},
    # two more families without an activation formula: Qwen3's q/k norms, Gemma 3's sliding + full layers
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
              "max_position_embeddings": 512},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "vocab_size": 512, "max_position_embeddings": 512, "sliding_window": 32,
                    "layer_types": ["sliding_attention", "full_attention"]},
}

QV_TARGETS = {
    # peft's defaults for these model types (peft.utils.constants TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
    # less phi's fc1 / fc2: the query and value projections; Falcon fuses them in query_key_value
    "opt": ("q_proj", "v_proj"), "gptj": ("q_proj", "v_proj"), "stablelm": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj"), "falcon": ("query_key_value",), "qwen3": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
}
