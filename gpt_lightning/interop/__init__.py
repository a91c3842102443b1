"""Files in and out: checkpoints, safetensors weights, Hugging Face GPT-2, the HellaSwag benchmark."""
