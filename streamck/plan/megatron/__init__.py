"""megatron-core ``torch_dist`` → Hugging Face (plan.py); its stacked key layout as data
(layout.py); the run's pickled ``args`` read as inert data (args.py); MoE layers (moe.py);
DeepSeek-V3's multi-latent attention as HF DeepseekV3 (mla.py, its table mla_layout.py, its
config checks mla_checks.py)."""
