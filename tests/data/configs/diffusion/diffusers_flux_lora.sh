# huggingface/diffusers examples/dreambooth/README_flux.md, the LoRA command, with the memory switches the README's
# "Memory Optimizations" section names (8-bit Adam instead of Prodigy, checkpointing, cached latents, rank 16)
export MODEL_NAME="black-forest-labs/FLUX.1-dev"
accelerate launch train_dreambooth_lora_flux.py \
  --pretrained_model_name_or_path="black-forest-labs/FLUX.1-dev"  \
  --instance_data_dir=dog \
  --output_dir=trained-flux-lora \
  --mixed_precision="bf16" \
  --instance_prompt="a photo of sks dog" \
  --resolution=512 \
  --train_batch_size=1 \
  --rank=16 \
  --guidance_scale=1 \
  --gradient_accumulation_steps=4 \
  --gradient_checkpointing \
  --cache_latents \
  --optimizer="AdamW" \
  --use_8bit_adam \
  --learning_rate=1e-4 \
  --report_to="wandb" \
  --lr_scheduler="constant" \
  --lr_warmup_steps=0 \
  --max_train_steps=500 \
  --seed="0"
