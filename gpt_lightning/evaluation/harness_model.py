"""``GPTHarnessLM``: our ``GPT`` as an lm-evaluation-harness ``TemplateLM``, answering its requests as
the harness's own ``hf`` model does (same truncation, windows and stop rules), with the GPT-2 tokenizer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from gpt_lightning.errors import UserError
from gpt_lightning.data.tokenizer import END_OF_TEXT, GPT2_VOCAB_SIZE, gpt2_encoding
from gpt_lightning.evaluation.continuations import score_continuations
from gpt_lightning.generation import generate
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.model import GPT

# generate_until's tokens come in rounds that double from this size, the stop sequences checked
# between rounds: a task stopping at "\n" does not pay for max_gen_toks (256) decode steps.
FIRST_ROUND_TOKENS = 16


class GPTHarnessLM(TemplateLM):
    """A ``GPT`` answering lm-evaluation-harness requests.

    Args:
        model: the GPT to score, moved to ``device`` (in eval mode while it answers; its mode kept).
        batch_size: requests per forward pass (loglikelihood), prompts per generation batch.
        device: where the model runs: ``cpu``, ``cuda``, ``cuda:1``, ...
        dtype: None runs the model in its own dtype; ``torch.bfloat16``/``torch.float16`` run it under
            autocast (the weights stay as they are, as in bf16-mixed training); ``torch.float32``
            casts the weights.
    """

    def __init__(self, model: GPT, *, batch_size: int = 8, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        self._device = torch.device(device)
        self.autocast_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
        self.gpt = model.to(device=self._device, dtype=dtype if dtype is not None and self.autocast_dtype is None else None)
        self.batch_size = batch_size
        self.encoding = gpt2_encoding()
        self.max_length = model.config.block_size
        self.vocab_limit = min(GPT2_VOCAB_SIZE, model.config.vocab_size)  # ids past the tokenizer's never decode
        self.max_gen_toks = 256  # the hf model's default when a task gives none

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs: Any) -> "GPTHarnessLM":
        """The model of a ``gpt-lightning fit`` checkpoint (``.ckpt`` or sharded folder); ``kwargs`` as for ``__init__``."""
        return cls(gpt_from_checkpoint(path), **kwargs)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.encoding.eot_token

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.encoding.encode(string, allowed_special={END_OF_TEXT})

    def tok_decode(self, tokens: list[int]) -> str:
        return self.encoding.decode(tokens)

    @contextlib.contextmanager
    def inference(self):
        """The model in eval mode (restored after), eager, no gradients, under ``dtype``'s autocast if any."""
        was_training = self.gpt.training
        self.gpt.eval()
        autocast = torch.autocast(self._device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), autocast:
                yield
        finally:
            self.gpt.train(was_training)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each request's continuation after its context."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        with self.inference():
            answers = score_continuations(self.gpt, pairs, self.batch_size, self._device)
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, in the harness's disjoint windows."""
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(string)
            for window in lm_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Text continuing each prompt until a stop sequence (``until``, and always ``<|endoftext|>``) or
        ``max_gen_toks`` tokens, greedy or sampled as ``gen_kwargs`` say, cut before the stop sequence."""
        batches = Collator([request.args for request in requests], sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                           group_by="gen_kwargs", group_fn=lambda args: args[1])
        out = []
        for chunk in batches.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=END_OF_TEXT)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise UserError(f"A generation task asks for up to {max_gen_toks} new tokens, which leaves no room for a "
                                f"prompt in the model's context of {self.max_length}: set its generation_kwargs.max_gen_toks "
                                "below that (in the task's YAML).")
            sampling = sampling_options(kwargs)
            prompts = [self.tok_encode(context)[-(self.max_length - max_gen_toks):] for context in contexts]
            for context, prompt, text in zip(contexts, prompts, self._generate(prompts, max_gen_toks, until, sampling)):
                text = postprocess_generated_text(text, until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
        return batches.get_original(out)

    def _generate(self, prompts: list[list[int]], max_gen_toks: int, until: list[str], sampling: dict[str, Any]) -> list[str]:
        """The decoded new tokens of each prompt, prompts of one length generated as one batch."""
        texts = [""] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(row)
        for rows in by_length.values():
            idx = torch.tensor([prompts[row] for row in rows], dtype=torch.long, device=self._device)  # (B, T)
            start, done, decoded = idx.size(1), 0, [""] * len(rows)
            while done < max_gen_toks:
                new = min(max_gen_toks - done, FIRST_ROUND_TOKENS << (done // FIRST_ROUND_TOKENS).bit_length())
                with self.inference():
                    idx = generate(self.gpt, idx, new, vocab_limit=self.vocab_limit, **sampling)  # (B, T + new)
                done += new
                decoded = [self.tok_decode(row) for row in idx[:, start:].tolist()]
                if all(any(stop in text for stop in until) for text in decoded):
                    break
            for row, text in zip(rows, decoded):
                texts[row] = text
        return texts


def sampling_options(gen_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate``'s ``temperature`` and ``top_k`` for the harness's ``gen_kwargs``: greedy unless
    ``do_sample`` (then ``temperature`` 1 unless given); anything else is refused rather than ignored."""
    kwargs = dict(gen_kwargs)
    do_sample = kwargs.pop("do_sample", False)
    temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
    top_k = kwargs.pop("top_k", None)
    top_p = kwargs.pop("top_p", None)
    if top_p not in (None, 1, 1.0):
        raise ValueError(f"gen_kwargs top_p={top_p}: gpt-lightning samples with temperature and top_k only.")
    if kwargs:
        raise ValueError(f"gen_kwargs {', '.join(sorted(kwargs))} are not supported: give do_sample, temperature, top_k, until, max_gen_toks.")
    if not do_sample or temperature == 0.0:
        return dict(temperature=0.0)
    return dict(temperature=temperature, top_k=int(top_k) if top_k else None)
