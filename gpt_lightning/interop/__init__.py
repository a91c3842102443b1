"""Files in and out: checkpoints (``checkpoint``), plain safetensors weights (``weights``), Hugging
Face GPT-2 (``pretrained``), the HellaSwag benchmark (``hellaswag``)."""
