"""Files in and out: checkpoints, plain weights, Hugging Face GPT-2, the HellaSwag benchmark.

- ``checkpoint``: reading a gpt-lightning checkpoint (a ``.ckpt`` file or a folder of shards);
- ``weights``: ``export_weights`` / ``load_gpt``, one safetensors file usable without Lightning;
- ``pretrained``: GPT-2 in Hugging Face format, to start from (``init_from``) and to export;
- ``hellaswag``: HellaSwag scoring, for ``gpt-lightning eval`` and the ``HellaSwagEval`` callback.
"""
