# kohya-ss/sd-scripts docs/flux_train_network.md, "basic command example" (paths filled in, a few
# logging / saving arguments left out)
accelerate launch --num_cpu_threads_per_process 1 flux_train_network.py \
  --pretrained_model_name_or_path="flux1-dev.safetensors" \
  --clip_l="clip_l.safetensors" \
  --t5xxl="t5xxl_fp16.safetensors" \
  --ae="ae.safetensors" \
  --dataset_config="kohya_flux_dataset.toml" \
  --output_dir="out" \
  --output_name="my_flux_lora" \
  --save_model_as=safetensors \
  --network_module=networks.lora_flux \
  --network_dim=16 \
  --network_alpha=1 \
  --learning_rate=1e-4 \
  --optimizer_type="AdamW8bit" \
  --lr_scheduler="constant" \
  --sdpa \
  --max_train_epochs=10 \
  --save_every_n_epochs=1 \
  --mixed_precision="fp16" \
  --gradient_checkpointing \
  --guidance_scale=1.0 \
  --timestep_sampling="flux_shift" \
  --model_prediction_type="raw" \
  --blocks_to_swap=18 \
  --cache_text_encoder_outputs \
  --cache_latents
