"""Tiny encoder-decoder and vision configs (transformers builds them in milliseconds): the tests and
bench/encdec_vision.py size and measure them."""

TINY_T5 = dict(model_type="t5", d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=2, num_heads=4,
               vocab_size=512, relative_attention_num_buckets=8, dropout_rate=0.1, feed_forward_proj="gated-gelu",
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
"""Flan-T5 style: gated-GELU feed-forward; encoder and decoder depths differ so each stack is sized on its own."""
TINY_BART = dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512,
                 max_position_embeddings=256, dropout=0.1)
TINY_VIT = dict(model_type="vit", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                image_size=32, patch_size=8, num_labels=10)
TINY_DINOV2 = dict(model_type="dinov2", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, mlp_ratio=2,
                   image_size=28, patch_size=14, num_labels=10)

TINY_ENCDEC_VISION = {"t5": TINY_T5, "bart": TINY_BART, "vit": TINY_VIT, "dinov2": TINY_DINOV2}
SHAPES = {"t5": ((4, 64, 32), (6, 96, 80)), "bart": ((4, 64, 32), (6, 96, 80)),
          "vit": ((8, 64), (16, 96)), "dinov2": ((8, 56), (16, 98))}
"""(micro-batch, source, target) / (micro-batch, image side in pixels): none of the fit's shapes."""


def setup_fields(family: str, shape: tuple[int, ...]) -> dict:
    if family in ("vit", "dinov2"):
        return {"micro_batch_size": shape[0], "image_size": shape[1]}
    return {"micro_batch_size": shape[0], "seq_len": shape[1], "target_len": shape[2]}
