"""Sizing a run to its hardware: sharding, memory and compute.

- ``sharding``: FSDP2 under Lightning's ``ModelParallelStrategy``, and building on the meta device;
- ``memory``: the memory per device of a run, computed (``python -m gpt_lightning.scaling.memory``);
- ``flops``: the training FLOPs of a batch, counted once on the meta device;
- ``dead_rank``: a rank that went away, told in one line with how to resume.
"""
