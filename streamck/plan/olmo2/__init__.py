"""``--plan olmo2``: an OLMo-core OLMo 2 checkpoint as Hugging Face's ``Olmo2ForCausalLM``."""
