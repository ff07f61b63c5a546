"""What transformers itself makes of an exported directory (run by ``.venv-hf``'s python, never imported
by the package): ``hf_reference.py DIR REQUEST.json OUT``.

REQUEST: ``input_ids`` (a batch: logits), ``texts`` (token ids with and without special tokens),
``chats`` (``[messages, add_generation_prompt, extra template variables]``: rendered text),
``prompt_ids`` + ``max_new_tokens`` (greedy ``generate``), optionally ``prompt_batches`` (``[prompts, max_length]``:
the RL prompt batches of MiniMind's ``train_ppo.py`` and ``train_grpo.py`` tokenizer calls). Writes ``OUT/logits.safetensors`` and
``OUT/result.json``. Loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``, no remote code.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(directory: str, request_file: str, out: str) -> None:
    request = json.loads(Path(request_file).read_text())
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=False, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    result = {"transformers": transformers.__version__, "model_class": type(model).__name__,
              "tokenizer_class": type(tokenizer).__name__}
    with torch.no_grad():
        logits = model(torch.tensor(request["input_ids"])).logits
        prompt = torch.tensor([request["prompt_ids"]])
        generated = model.generate(prompt, max_new_tokens=request["max_new_tokens"], do_sample=False)
    save_file({"logits": logits.contiguous()}, str(Path(out) / "logits.safetensors"))
    result["generated"] = generated[0, prompt.shape[1]:].tolist()
    result["generated_text"] = tokenizer.decode(result["generated"], skip_special_tokens=True)
    result["ids"] = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in request["texts"]]
    result["ids_default"] = [tokenizer(t)["input_ids"] for t in request["texts"]]
    result["chats"] = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **extra)
                       for messages, gen, extra in request["chats"]]
    result["ppo_batches"], result["grpo_batches"] = [], []
    for prompts, max_length in request.get("prompt_batches", []):
        ppo = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_length,
                        padding_side="left")  # train_ppo.py
        grpo = tokenizer(prompts, return_tensors="pt", padding=True, return_token_type_ids=False, padding_side="left",
                         add_special_tokens=False)  # train_grpo.py, then its slice
        result["ppo_batches"].append([ppo["input_ids"].tolist(), ppo["attention_mask"].tolist()])
        result["grpo_batches"].append([grpo["input_ids"][:, -max_length:].tolist(),
                                       grpo["attention_mask"][:, -max_length:].tolist()])
    (Path(out) / "result.json").write_text(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main(*sys.argv[1:])
