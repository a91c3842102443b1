"""``GPTHarnessLM``: our ``GPT`` as an lm-evaluation-harness ``TemplateLM``, answering its requests as
the harness's own ``hf`` model does (same truncation, windows and stop rules)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from gpt_lightning.data.tokenizer import END_OF_TEXT, GPT2_VOCAB_SIZE, gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.continuations import score_continuations
from gpt_lightning.generation import generate
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.model import GPT

# generate_until decodes in rounds doubling from this size, checking the stop sequences between them.
FIRST_ROUND_TOKENS = 16


def available_memory() -> int:
    """Bytes this machine can hand out without swapping: Linux's MemAvailable, else the free pages, or
    all pages where the OS counts none (macOS)."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except ValueError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class GPTHarnessLM(TemplateLM):
    """A ``GPT`` answering lm-evaluation-harness requests.

    Args:
        model: the GPT to score, moved to ``device`` (in eval mode while it answers; its mode kept).
        batch_size: requests per forward pass (loglikelihood), prompts per generation batch.
        device: where the model runs: ``cpu``, ``cuda``, ``cuda:1``, ...
        dtype: None runs the model as it is, under whatever autocast is open; ``torch.bfloat16`` or
            ``torch.float16`` run it under autocast; ``torch.float32`` casts the weights, autocast off.
    """

    def __init__(
        self, model: GPT, *, batch_size: int = 8, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        self._device = torch.device(device)
        self.autocast_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
        self.dtype = dtype
        self.gpt = model.to(
            device=self._device, dtype=dtype if dtype is not None and self.autocast_dtype is None else None
        )
        self.batch_size = batch_size
        self.encoding = gpt2_encoding()
        self.max_length = model.config.block_size
        self.vocab_limit = min(GPT2_VOCAB_SIZE, model.config.vocab_size)  # ids past the tokenizer's never decode
        self.max_gen_toks = 256  # the hf model's default when a task gives none

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs: Any) -> GPTHarnessLM:
        """The model of a ``gpt-lightning fit`` checkpoint (``.ckpt`` or sharded folder); ``kwargs`` as for ``__init__``."""
        return cls(gpt_from_checkpoint(path), **kwargs)

    def auto_batch_size(self, maximum: int = 64) -> int:
        """The largest batch size, halving from ``maximum``, at which a whole window fits in memory: tried
        on a GPU; on a CPU, where running out kills the process, estimated against a quarter of it."""
        block, vocab = self.max_length, self.gpt.config.vocab_size
        request = ([self.prefix_token_id], [i % self.vocab_limit for i in range(block)])

        def fits(size: int) -> bool:
            if self._device.type != "cuda":  # logits, their float32 copy, log-softmax
                return size * block * vocab * 4 * 3 <= available_memory() // 4
            try:
                with self.inference():
                    score_continuations(self.gpt, [request] * size, size, self._device)
                return True
            except torch.cuda.OutOfMemoryError:
                return False
            finally:
                torch.cuda.empty_cache()

        return largest_batch_size(fits, maximum)

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
        autocast = (
            contextlib.nullcontext()
            if self.dtype is None
            else torch.autocast(self._device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        )
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), autocast:
                yield
        finally:
            self.gpt.train(was_training)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """As the harness's ``TemplateLM`` encodes them, a whitespace-only context as an empty one; a
        continuation longer than the model's context is refused."""
        encoded = []
        for request in requests:
            context, continuation = request.args
            if context.strip():
                context_enc, continuation_enc = self._encode_pair(context, continuation)
            else:  # the harness's rule for an empty context: <|endoftext|> first, unless the text starts with it
                continuation_enc = self.tok_encode(context + continuation)
                if continuation_enc[:1] == [self.prefix_token_id]:
                    context_enc, continuation_enc = continuation_enc[:1], continuation_enc[1:]
                else:
                    context_enc = [self.prefix_token_id]
            if len(continuation_enc) > self.max_length:
                raise UserError(
                    f"Task {request.task_name}: a continuation of {len(continuation_enc)} tokens (document "
                    f"{request.doc_id}) is longer than the model's context of {self.max_length}: score such "
                    "text as a loglikelihood_rolling task, or shorten doc_to_target."
                )
            encoded.append(((context, continuation), context_enc, continuation_enc))
        return self._loglikelihood_tokens(encoded)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation; each batch's answers are cached as it finishes."""
        pairs = [(context, continuation) for _, context, continuation in requests]

        def cache(indices: list[int], answers: list[tuple[float, bool]]) -> None:
            for i in indices:
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answers[i])
            if getattr(self.cache_hook, "dbdict", None) is not None:
                self.cache_hook.dbdict.commit()

        with self.inference():
            return score_continuations(self.gpt, pairs, self.batch_size, self._device, on_batch=cache)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, in the harness's disjoint windows."""
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(string)
            for window in lm_utils.get_rolling_token_windows(
                tokens, self.prefix_token_id, self.max_length, context_len=1
            ):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Text continuing each prompt until a stop sequence (always ``<|endoftext|>`` too) or
        ``max_gen_toks`` tokens, as ``gen_kwargs`` say."""
        checked = {}  # every task's generation_kwargs before any generation, each once
        for request in requests:
            if checked.setdefault((request.task_name, repr(request.args[1])), request) is request:
                self._generation_options(request.args[1], request.task_name)
        batches = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        out = []
        for chunk in batches.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            until, max_gen_toks, sampling = self._generation_options(all_kwargs[0])
            # An empty prompt starts after <|endoftext|>, as an empty loglikelihood context does.
            prompts = [
                (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - max_gen_toks) :]
                for context in contexts
            ]
            for context, text in zip(contexts, self._generate(prompts, max_gen_toks, until, sampling)):
                text = postprocess_generated_text(text, until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
        return batches.get_original(out)

    def _generation_options(
        self, gen_kwargs: dict[str, Any], task: str | None = None
    ) -> tuple[list[str], int, dict[str, Any]]:
        """(stop sequences, max_gen_toks, ``generate``'s sampling options) of a request's ``gen_kwargs``: greedy
        unless ``do_sample``; anything else is refused rather than ignored."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)  # a copy
        until = handle_stop_sequences(kwargs.pop("until", None), eos=END_OF_TEXT)
        max_gen_toks = kwargs.pop("max_gen_toks")
        do_sample = kwargs.pop("do_sample", False)
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        top_k = kwargs.pop("top_k", None)
        top_p = kwargs.pop("top_p", None)
        where = f"Task {task}" if task else "A generation task"
        if max_gen_toks >= self.max_length:
            raise UserError(
                f"{where} asks for up to {max_gen_toks} new tokens, which leaves no room for a "
                f"prompt in the model's context of {self.max_length}: set its generation_kwargs.max_gen_toks "
                "below that (in the task's YAML)."
            )
        if kwargs:
            raise UserError(
                f"{where}: generation_kwargs {', '.join(sorted(kwargs))} not supported: give only do_sample, "
                "temperature, top_k, top_p, until, max_gen_toks."
            )
        if top_p is not None and not 0 < float(top_p) <= 1:
            raise UserError(f"{where}: generation_kwargs top_p must be in (0, 1], got {top_p}.")
        if not do_sample or temperature == 0.0:
            return until, max_gen_toks, dict(temperature=0.0)
        top_p = float(top_p) if top_p is not None else None
        return until, max_gen_toks, dict(temperature=temperature, top_k=int(top_k) if top_k else None, top_p=top_p)

    def _generate(
        self, prompts: list[list[int]], max_gen_toks: int, until: list[str], sampling: dict[str, Any]
    ) -> list[str]:
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


def largest_batch_size(fits, maximum: int) -> int:
    """The first of ``maximum``, ``maximum // 2``, ... 1 for which ``fits(size)``; 1 if none does."""
    size = maximum
    while size > 1 and not fits(size):
        size //= 2
    return size
