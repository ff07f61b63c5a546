"""Run in ``.venv-hf`` (transformers): build the toy reward model directory and score requests with it directly.

``python hf_toy_reward.py DIR TOKENIZER_DIR REQUESTS.json RESULT.json``: writes DIR (remote-code config, seeded
weights, the tokenizer files), then ``{"scores": [...]}`` of ``model.get_score(tokenizer, messages)`` for each
request's messages, loaded back through ``AutoModel`` / ``AutoTokenizer`` with ``trust_remote_code`` as MiniMind's
``LMForRewardModel`` does.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "toy_reward"


def main() -> None:
    directory, tokenizer_dir, requests, result = (Path(a) for a in sys.argv[1:5])
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "modeling_toy_reward.py", directory)
    sys.path.insert(0, str(directory))
    from modeling_toy_reward import ToyRewardConfig, ToyRewardModel
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    config = ToyRewardConfig(auto_map={"AutoConfig": "modeling_toy_reward.ToyRewardConfig",
                                       "AutoModel": "modeling_toy_reward.ToyRewardModel"})
    ToyRewardModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    model = AutoModel.from_pretrained(directory, trust_remote_code=True).eval()
    scores = [model.get_score(tokenizer, messages) for messages in json.loads(requests.read_text())]
    result.write_text(json.dumps({"scores": scores}))


if __name__ == "__main__":
    main()
