"""Diffusion fine-tuning (issue 24, first slice): the denoiser's training step (Flux, SD3 / 3.5, SDXL's UNet) traced
on fake tensors at the latent / token shape a resolution gives, the frozen text encoders and VAE as their own phases,
and `memfit diffusion`."""
