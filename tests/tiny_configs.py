"""Tiny HF configs as plain dicts (hidden 64, 2 layers, 4 heads, vocab 512): real architectures, random weights,
fast on CPU. Shared by every test file that builds a model; copy before mutating (`dict(TINY_LLAMA, ...)`)."""

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

TINY_MISTRAL = {
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "sliding_window": None,
}

TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 256,
    "vocab_size": 512,
    "n_positions": 512,
    "bos_token_id": 0,  # the real 50256 lies outside a 512-token vocabulary and makes transformers warn
    "eos_token_id": 0,
}

TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}

TINY_CONFIGS = {
    "llama": TINY_LLAMA,
    "mistral": TINY_MISTRAL,
    "qwen2": TINY_QWEN2,
    "gpt2": TINY_GPT2,
    "bert": TINY_BERT,
}
