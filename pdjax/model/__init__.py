"""Pure-functional DeepSeek-V2/V3 model code (MLA, MoE, latent KV cache, HF loading)."""
