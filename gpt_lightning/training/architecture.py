"""The GPT a ``GPTLightningModule`` trains: built from the module's options, or from a pretrained
Hugging Face GPT-2 (``init_from``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from gpt_lightning.errors import UserError
from gpt_lightning.interop.pretrained import agree_with_pretrained
from gpt_lightning.model import GPT, GPTConfig

DEFAULT_CONFIG = GPTConfig()  # the architecture defaults live in GPTConfig alone


def build_gpt(hparams: Mapping[str, Any]) -> tuple[GPTConfig, GPT, dict[str, Any]]:
    """The config and the GPT for a module's hyper-parameters (GPTConfig's fields, ``block_size``
    None for "not given", and ``init_from``), and the hyper-parameters to record beside them so
    that checkpoints load without the pretrained source: ``(config, model, to_record)``.

    With ``init_from`` the source's config gives the architecture (options left at their defaults
    take its values, one set otherwise must agree) and its weights become the model's, without a
    random initialization first. Without it the GPT is built where the caller builds: on the CPU,
    randomly initialized; or, under ``torch.device("meta")`` (``trainer.init_module(empty_init=True)``,
    the CLI under ``ModelParallelStrategy``), empty until ``configure_model`` shards it and gives each
    rank's shard the values an eager build would have drawn (``gpt_lightning.scaling.sharding``).
    """
    options = {f.name: hparams[f.name] for f in fields(GPTConfig)}
    init_from, to_record, pretrained_state = hparams.get("init_from"), {}, None
    if init_from is not None:
        given = {k: v for k, v in options.items() if k != "dropout"}
        architecture, pretrained_state = agree_with_pretrained(given, init_from)
        to_record = {**architecture, "init_from": None, "pretrained_from": init_from}
        options.update(architecture)
    elif options["block_size"] is None:
        options["block_size"] = DEFAULT_CONFIG.block_size
        to_record = {"block_size": options["block_size"]}  # checkpoints record the size built
    try:
        config = GPTConfig(**options)
    except ValueError as err:
        hint = " (the CLI sets it from data.block_size)" if "block_size" in str(err) else ""
        raise UserError(str(err).replace("GPTConfig.", "model.") + hint) from err
    if pretrained_state is not None:
        return config, GPT.from_state_dict(config, pretrained_state), to_record  # no random init, no copy
    return config, GPT(config), to_record
