"""A transformers reward model (MiniMind's InternLM2-1.8B-Reward) scoring answers for GRPO, run in a Python of its own.

MiniMind's ``LMForRewardModel`` loads the directory with ``AutoTokenizer`` / ``AutoModel`` and
``trust_remote_code`` and calls the model's ``get_score(tokenizer, messages)``. transformers is kept out of
the project's environment (it once broke torchmetrics there), so this file runs as a script in a Python that
has it (``--model.reward_python``): it reads one JSON line per request, ``{"messages": [...]}``, and writes
``{"score": float}``; its first line is ``{"ready": true}`` or ``{"error": "..."}``. It imports nothing of
lit_minimind. :class:`lit_minimind.model.grpo.TransformersScorer` is the other end.
"""

import json
import sys


def main() -> None:
    directory = sys.argv[1]
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        print(json.dumps({"error": f"{sys.executable} cannot import transformers ({exc})"}), flush=True)
        return
    try:
        cuda = torch.cuda.is_available()
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
        model = AutoModel.from_pretrained(directory, dtype=torch.float16 if cuda else torch.float32,
                                          trust_remote_code=True).to("cuda" if cuda else "cpu").eval()
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported to the trainer in one line
        print(json.dumps({"error": f"{directory}: {type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        with torch.no_grad():
            score = float(model.get_score(tokenizer, json.loads(line)["messages"]))
        print(json.dumps({"score": score}), flush=True)


if __name__ == "__main__":
    main()
