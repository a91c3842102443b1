"""GPT-2 checkpoints in Hugging Face format, both ways (to start from, and for ``from_pretrained``); our
names are GPT-2's, bar ``Conv1D``'s transposes, a ``transformer.`` prefix, mask buffers and the tied head."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gpt_lightning.atomic import atomic_output
from gpt_lightning.config import MODERN_SWITCHES, GPTConfig, modern_switches_on
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT

HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # not ".c_attn.bias", a real weight
_TIED = "lm_head.weight"
# GPTConfig field -> Hugging Face GPT2Config key
_CONFIG_KEYS = {"block_size": "n_positions", **{name: name for name in ("vocab_size", "n_layer", "n_head", "n_embd")}}


def _local_files(source: str) -> tuple[Path, Path]:
    """(config.json, weights file) of a local directory or weights file, or of a hub model."""
    path = Path(source).expanduser()
    if path.is_file():
        config = path.parent / "config.json"
        if not config.is_file():
            raise UserError(f"{path} has no config.json beside it: a Hugging Face GPT-2 checkpoint needs both.")
        return config, path
    if path.is_dir():
        weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
        if weights is None or not (path / "config.json").is_file():
            raise UserError(
                f"{path} is not a Hugging Face GPT-2 directory: it needs config.json and one of {', '.join(WEIGHT_FILES)}."
            )
        return path / "config.json", weights
    if source in HUB_MODELS:
        return _from_hub(source)
    raise UserError(f"init_from {source!r} is neither a local directory or file nor one of {', '.join(HUB_MODELS)}.")


def _from_hub(name: str) -> tuple[Path, Path]:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(name, "config.json")), Path(hf_hub_download(name, "model.safetensors"))
    except ImportError:
        raise UserError(f"Loading {name!r} from the hub needs huggingface_hub: pip install huggingface_hub.") from None
    except Exception as err:  # offline, a proxy, a rate limit: say what to do instead
        raise UserError(
            f"Could not fetch {name!r} from the Hugging Face hub ({type(err).__name__}). It is needed once, "
            f"online (it is cached); offline, give init_from (fit's --model.init_from, eval's --init_from) a local "
            f"copy instead: /path/to/{name} (a directory with config.json and model.safetensors)."
        ) from None


def read_hf_gpt2(source: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The architecture and the weights, in our names and layout, of a Hugging Face GPT-2 checkpoint:
    ``source`` is a hub name (``gpt2`` ... ``gpt2-xl``), a directory, or a weights file with ``config.json``."""
    config_path, weights_path = _local_files(source)
    hf = json.loads(config_path.read_text())
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"{config_path}: activation {hf['activation_function']!r}; GPT-2's is gelu_new (tanh GELU).")
    config = GPTConfig(**{ours: hf[theirs] for ours, theirs in _CONFIG_KEYS.items()}, dropout=0.0, bias=True)
    if weights_path.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw = load_file(str(weights_path))
    else:
        raw = torch.load(weights_path, map_location="cpu", weights_only=True)
    state: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        key = key if key.startswith(("transformer.", _TIED)) else f"transformer.{key}"
        if key.endswith(_MASK_BUFFERS) or key == _TIED:
            continue  # causal-mask buffers; the LM head is the (tied) token embedding
        state[key] = value.t().contiguous() if key.endswith(_CONV1D) else value
    with torch.device("meta"):
        expected = set(GPT(config).state_dict()) - {_TIED}
    differences = {"missing": sorted(expected - set(state)), "unexpected": sorted(set(state) - expected)}
    if any(differences.values()):
        said = "; ".join(f"{what} {', '.join(keys[:5])}" for what, keys in differences.items() if keys)
        raise UserError(f"{weights_path} does not match its config.json as GPT-2: {said}.")
    return config, state


def export_hf(model: GPT, out_dir: str | Path) -> Path:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors) with the
    GPT-2 tokenizer files beside it, so ``GPT2LMHeadModel`` and ``AutoTokenizer`` load it."""
    from safetensors.torch import save_file

    from gpt_lightning.data.tokenizer import bpe_files

    switches = modern_switches_on(model.config)
    if switches:
        raise UserError(
            f"--format hf writes Hugging Face GPT-2, which has none of this model's {', '.join(switches)}. "
            "Use --format safetensors (loaded back by gpt_lightning.load_gpt)."
        )
    out_dir = Path(out_dir)
    c = model.config
    state = {
        key: (value.t() if key.endswith(_CONV1D) else value).contiguous().cpu()
        for key, value in model.state_dict().items()
        if key != _TIED
    }
    config: dict[str, Any] = {  # the rest (layer norm epsilon, tied head, end-of-text ids) GPT2Config's defaults
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        **{theirs: getattr(c, ours) for ours, theirs in _CONFIG_KEYS.items()},
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "gpt_lightning_config": asdict(c),
    }
    vocab_bpe, encoder_json = bpe_files()
    files = {
        "config.json": json.dumps(config, indent=2).encode(),
        "vocab.json": Path(encoder_json).read_bytes(),
        "merges.txt": Path(vocab_bpe).read_bytes(),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "model_max_length": c.block_size,
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
            }
        ).encode(),
    }
    for name, data in files.items():
        with atomic_output(out_dir / name) as tmp:
            tmp.write_bytes(data)
    with atomic_output(out_dir / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    return out_dir


def agree_with_pretrained(given: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The architecture and weights to start from ``source``: an option in ``given`` left at its default
    takes the checkpoint's value, one set otherwise must agree; ``block_size`` may crop the position table."""
    switches = modern_switches_on(GPTConfig(**{k: v for k, v in given.items() if k in MODERN_SWITCHES}))
    if switches:  # before reading (or downloading) the weights
        raise UserError(
            f"model.init_from loads Hugging Face GPT-2, which has none of {', '.join(f'model.{s}' for s in switches)}. "
            "Leave those at GPT-2's defaults, or train the modern model from scratch without model.init_from."
        )
    theirs, state = read_hf_gpt2(source)
    defaults = GPTConfig()
    resolved: dict[str, Any] = {}
    for name in ("vocab_size", "n_layer", "n_head", "n_embd", "bias"):
        value, pretrained = given[name], getattr(theirs, name)
        if value != getattr(defaults, name) and value != pretrained:
            raise UserError(
                f"model.{name} {value} contradicts {source}'s {pretrained}. Leave model.{name} out to take "
                "the checkpoint's, or start from scratch without model.init_from."
            )
        resolved[name] = pretrained
    block_size = theirs.block_size if given["block_size"] is None else given["block_size"]
    if block_size > theirs.block_size:
        raise UserError(
            f"model.block_size {block_size} is longer than {source}'s position table ({theirs.block_size}): a "
            f"pretrained model cannot be lengthened. Use data.block_size <= {theirs.block_size}."
        )
    resolved["block_size"] = block_size
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:block_size].contiguous()
    return resolved, state


def gpt_from_hf(source: str) -> GPT:
    """A plain ``GPT`` with the weights of a Hugging Face GPT-2 checkpoint, as it is."""
    config, state = read_hf_gpt2(source)
    return GPT.from_state_dict(config, state)
