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
    """``(config, model, to_record)`` for a module's hyper-parameters, from ``init_from`` or fresh;
    ``to_record`` lets checkpoints load without the pretrained source."""
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
