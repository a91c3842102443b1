"""Sizing a run to its hardware: ``sharding`` (FSDP2), ``memory``, ``flops``, ``dead_rank``, ``launched_ranks``."""
