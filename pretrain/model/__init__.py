"""The model and its parts: the decoder (`transformer`), the fused LM loss, the classification
head, and Llama interop with Hugging Face (`hf`). No DeepSpeed, no data code."""
