"""Sizing a run to its hardware: ``sharding`` (FSDP2), ``swapped_checkpoints``, ``memory``, ``flops``."""
