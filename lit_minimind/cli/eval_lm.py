"""The lm-evaluation-harness model adapter of ``python -m lit_minimind.eval``: :class:`MiniMindLM`.

lm-eval asks a model three things: the log-likelihood of a continuation given a context (multiple choice),
the rolling log-likelihood of a whole text (perplexity), and a generation until a stop string. This module
answers them with the project's own model and tokenizer (no transformers); lm-eval does everything else:
prompts, few-shot, filters, metrics, aggregation, the table.

It imports ``lm_eval`` at the top, so only :mod:`lit_minimind.cli.eval` imports it, after checking that
lm-eval is installed. What it does, the way lm-eval's own ``hf`` model does it:

- **BOS**: the model was trained on ``<|im_start|>`` + text (``data/dataset.py``), so every encoded string
  starts with ``BOS_ID`` (lm-eval's ``hf`` with ``add_bos_token=True``), unless it already does (a chat
  template's prompt); an empty context is the BOS alone (lm-eval's ``prefix_token_id``).
- **Context / continuation**: lm-eval's ``TemplateLM.loglikelihood`` (inherited, not rewritten): trailing
  spaces of the context move into the continuation, the pair is encoded whole and the continuation's
  tokens are those past the context's.
- **Truncation**: an input longer than the model's context (``max_length``: ``max_position_embeddings``
  unless told) keeps its last ``max_length + 1`` tokens (left truncation); a generation's context its last
  ``max_length - max_gen_toks``.
- **is_greedy**: every continuation token is the argmax of the model's distribution at its position.
- **Batches**: log-likelihoods in batches of ``batch_size``, longest first, right-padded (the model is causal:
  padding after a sequence changes none of its logits); generations one at a time (the model has no
  position ids, so left padding would shift the rotary positions), greedy unless the task samples.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer
from tqdm import tqdm

from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from lit_minimind.model import MiniMindForCausalLM
from lit_minimind.model.minimind import sample_tokens

__all__ = ["MiniMindLM"]


class MiniMindLM(TemplateLM):
    """A MiniMind model (``lit_minimind.cli.generate.load``) as an lm-eval ``LM``."""

    backend = "causal"

    def __init__(self, model: MiniMindForCausalLM, tokenizer: Tokenizer, *, batch_size: int = 1,
                 max_length: int | None = None, max_gen_toks: int = 256, device: str = "cpu",
                 chat_template: str | None = None, name: str = "minimind") -> None:
        super().__init__()
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self._chat_template = chat_template
        self.name = name

    # -- tokens ---------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return EOS_ID

    @property
    def prefix_token_id(self) -> int:
        return BOS_ID

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """The tokenizer's ids of ``string``, after ``BOS_ID`` unless ``add_special_tokens`` is False or they
        already start with it; the last ``left_truncate_len`` of them if given."""
        ids = self.tokenizer.encode(string, add_special_tokens=False).ids
        if add_special_tokens is not False and ids[:1] != [BOS_ID]:
            ids = [BOS_ID, *ids]
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: int | list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([tokens] if isinstance(tokens, int) else list(tokens),
                                     skip_special_tokens=skip_special_tokens)

    # -- log-likelihoods ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation token), every one the argmax)`` for each ``(key, context, continuation)``."""
        order = sorted(range(len(requests)),
                       key=lambda i: (-len(requests[i][1]) - len(requests[i][2]), tuple(requests[i][1] + requests[i][2])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for start in range(0, len(order), max(self.batch_size, 1)):
            batch = order[start:start + max(self.batch_size, 1)]
            inputs = []
            for i in batch:
                _, context, continuation = requests[i]
                if not context or not continuation:
                    raise ValueError("a log-likelihood request needs a context and a continuation token")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's context "
                                     f"({self.max_length})")
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])  # left truncation
            width = max(len(x) for x in inputs)
            batched = torch.tensor([x + [PAD_ID] * (width - len(x)) for x in inputs], device=self._device)
            log_probs = F.log_softmax(self.model(batched).logits.float(), dim=-1)
            for row, i, inp in zip(log_probs, batch, inputs):
                key, _, continuation = requests[i]
                cont = torch.tensor(continuation, device=self._device)
                scored = row[len(inp) - len(continuation):len(inp)]  # the positions predicting the continuation
                answer = (float(scored.gather(-1, cont[:, None]).sum()), bool((scored.argmax(-1) == cont).all()))
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text given the BOS, in lm-eval's disjoint rolling windows of
        ``max_length`` tokens (each token predicted once, with as much context as fits)."""
        results = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="Running loglikelihood_rolling"):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows], disable_tqdm=True))
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    # -- generation -----------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued until a stop string, the EOS or ``max_gen_toks`` tokens; the text before the
        first stop string (lm-eval's ``postprocess_generated_text``)."""
        eos = self.tok_decode(EOS_ID, skip_special_tokens=False)
        results = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm,
                                        desc="Running generate_until requests"):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room in the model's context ({self.max_length})")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            new = self._generate(ids, max_gen_toks, until, sample, float(kwargs.get("temperature", 0.0)),
                                 float(kwargs.get("top_p", 1.0)), int(kwargs.get("top_k", 0) or 0))
            text = postprocess_generated_text(self.tok_decode(new), stop=until, think_end_token=None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def _generate(self, ids: list[int], max_new: int, until: list[str], sample: bool, temperature: float,
                  top_p: float, top_k: int) -> list[int]:
        """New tokens after ``ids`` (``model.minimind.sample_tokens``: the calls ``MiniMindForCausalLM.generate``
        makes), stopping after the first that completes a stop string, before an EOS, or at ``max_new``."""
        new: list[int] = []
        tokens = sample_tokens(self.model, torch.tensor([ids], device=self._device), max_new,
                               temperature if sample else 0.0, top_p, top_k, eos_token_id=EOS_ID)
        for token in tokens:
            new.append(token)
            if len(ids) + len(new) >= self.max_length:
                break
            text = self.tok_decode(new)
            if any(stop and stop in text for stop in until):
                break
        return new

    # -- chat template (--apply_chat_template) --------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return self.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return render_chat(chat_history, self._chat_template, add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        config = self.model.config
        return {"model_num_parameters": self.model.num_parameters(), "model_dtype": str(next(self.model.parameters()).dtype),
                "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                "use_moe": bool(config.use_moe), "max_length": self.max_length}
