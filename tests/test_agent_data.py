"""Agent RL data (lit_minimind.data.agent): MiniMind's AgentRLDataset items of the embedded demo, the chat
template's renderings a rollout makes, one clear line for each bad record; the multi-turn rollout
(lit_minimind.model.agent.rollout_one) against MiniMind's rollout_single on scripted turns."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from lit_minimind.data.agent import EMBEDDED_AGENT_DATA, AgentDataset, collate_agent
from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.tokenizer import EOS_ID, PAD_ID, load_tokenizer
from lit_minimind.errors import DataError
from lit_minimind.model.agent import TOOL_NAMES, Trajectory, pack, rollout_one, tool_result, validate_gt_in_text

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "minimind" / "tokenizer"

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "agent" / "tools.json").read_text(encoding="utf-8"))
TURN = [{"role": "assistant", "content": '<think>\n想一想\n</think>\n\n<tool_call>\n{"name": "calculate_math", '
         '"arguments": {"expression": "1+1"}}\n</tool_call>'}, {"role": "tool", "content": '{"result": "2"}'},
        {"role": "tool", "content": '{"error": "tool not found"}'}]


def test_demo_items_are_minimind_s(tmp_path):
    data = AgentDataset(cache_dir=tmp_path)
    assert len(data) == len(FIXTURE["dataset"]) >= 20
    for i, expected in enumerate(FIXTURE["dataset"]):
        assert data[i] == expected["item"]


def test_rollout_renderings_are_minimind_s(tmp_path):
    data = AgentDataset(cache_dir=tmp_path)
    rendered = [(i, e["renders"]) for i, e in enumerate(FIXTURE["dataset"]) if "renders" in e]
    assert len(rendered) == 3
    for i, renders in rendered:
        messages, tools = data[i]["messages"], data[i]["tools"]
        for think in (False, True):
            assert render_chat(messages, add_generation_prompt=True, tools=tools, open_thinking=think) == \
                renders[f"prompt_think{int(think)}"]
            assert render_chat(messages + TURN, add_generation_prompt=True, tools=tools, open_thinking=think) == \
                renders[f"observe_think{int(think)}"]
            assert render_chat(messages + TURN, add_generation_prompt=False, tools=tools, open_thinking=think) == \
                renders[f"unfinished_think{int(think)}"]
        assert render_chat(messages, add_generation_prompt=True, tools=tools) == renders["scorer_prompt"]


def test_demo_questions_need_the_six_tools_and_their_gt_is_reachable(tmp_path):
    """Every tool is offered and asked for; each numeric gt is one a tool's mock result gives."""
    data = AgentDataset(cache_dir=tmp_path)
    offered = {t["function"]["name"] for i in range(len(data)) for t in data[i]["tools"]}
    assert offered == set(TOOL_NAMES)
    batch = collate_agent([data[0], data[1]])
    assert list(batch) == ["messages", "tools", "gt"] and len(batch["gt"]) == 2
    assert validate_gt_in_text(tool_result("calculate_math", {"expression": "12*7+5"}), data[0]["gt"]) == {"89"}
    assert EMBEDDED_AGENT_DATA.is_file()


def record(**change):
    rec = {"conversations": [{"role": "system", "content": "s", "tools": json.dumps([{"type": "function", "function": {
        "name": "calculate_math"}}])}, {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": ""}],
        "gt": ["2"]}
    rec.update(change)
    return rec


BAD = [
    ({k: v for k, v in record().items() if k != "gt"}, 'line 2: no "gt"'),
    (record(gt="2"), 'line 2: "gt" must be an array of strings or numbers, got string'),
    (record(gt=[["2"]]), "line 2: gt[0] must be a string or a number"),
    (record(gt=[True]), "line 2: gt[0] must be a string or a number"),
    (record(conversations=[{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]), "line 2: no tools"),
    (record(conversations=[{"role": "system", "content": "s", "tools": "[]"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": ""}]), "line 2: no tools"),
    (record(conversations=[{"role": "system", "content": "s", "tools": "[{\"type\": \"function\"}]"},
                           {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]), "tools[0] has no"),
    (record(conversations=[{"role": "system", "content": "s", "tools": "[{"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": ""}]), '"tools" is a string but not valid JSON'),
    (record(conversations=[{"role": "system", "content": "s", "tools": json.dumps([{"function": {"name": "x"}}])},
                           {"role": "user", "content": "q"}]), "last message must be the assistant's"),
    (record(conversations=[{"role": "assistant", "content": ""}]), "no prompt"),
    ({"text": "pretraining"}, "line 2: "),
]


@pytest.mark.parametrize("bad, message", BAD, ids=range(len(BAD)))
def test_bad_record_is_one_line_naming_file_and_line(tmp_path, bad, message):
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps(record(), ensure_ascii=False) + "\n" + json.dumps(bad, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    with pytest.raises(DataError) as err:
        AgentDataset(path, cache_dir=tmp_path / "cache")
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


class ScriptedModel(torch.nn.Module):
    """A stand-in policy (no real tiny model calls tools three turns running): ``generate`` answers each call
    with the script's next text + EOS; a forward gives the fixture engine's made-up log-probs
    ``-0.5 - i / 100`` of the i-th new token (logits put all but that mass nowhere)."""

    def __init__(self, tokenizer, texts):
        super().__init__()
        self.tokenizer, self.texts, self.weight = tokenizer, list(texts), torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, max_new_tokens, **_):
        new = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False).ids + [EOS_ID]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)

    def forward(self, ids, attention_mask=None, logits_to_keep=0):
        n = logits_to_keep - 1
        logits = torch.full((1, n + 1, 6400), -1e4)
        for i, token in enumerate(ids[0, -n:].tolist()):
            logits[0, i, token] = 0.0
            logits[0, i, (token + 1) % 6400] = math.log(math.exp(0.5 + i / 100) - 1)  # p(token) = exp(-0.5 - i/100)
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("case", range(len(FIXTURE["scripted"])))
def test_multi_turn_rollout_is_minimind_s(tmp_path, case):
    """Prompt, the model's tokens (mask 1, their log-probs) and the re-rendered contexts and tool results
    between turns (mask 0), the turns' texts, unfinished: as MiniMind's rollout_single, up to three turns."""
    expected = FIXTURE["scripted"][case]
    data = AgentDataset(cache_dir=tmp_path)[expected["record"]]
    tokenizer = load_tokenizer(TOKENIZER)
    model = ScriptedModel(tokenizer, FIXTURE["scripts"][expected["script"]])
    rng = random.Random(0)
    got = rollout_one(model, tokenizer, data["messages"], data["tools"], 64, expected["thinking_ratio"], rng)
    assert got.prompt_ids == expected["prompt_ids"]
    assert got.response_ids == expected["response_ids"]
    assert got.response_mask == expected["response_mask"]
    assert got.response_old_logps == pytest.approx(expected["old_logps"], abs=1e-5)
    assert got.turn_outputs == expected["turn_outputs"] and got.completion == expected["final"]
    assert (got.unfinished, got.context) == (expected["unfinished"], expected["context"])


def test_fixture_scripts_reach_three_turns_and_the_cut():
    assert any(r["unfinished"] and len(r["turn_outputs"]) == 3 for r in FIXTURE["scripted"])
    t = Trajectory(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], response_mask=[1, 0, 1, 1],
                   response_old_logps=[-0.1, 0.0, -0.3, -0.4])
    ids, mask, old = pack([t, Trajectory(prompt_ids=[5], response_ids=[], response_mask=[])], max_total_len=5)
    assert ids.tolist() == [[7, 8, 9, 10, 11], [5, PAD_ID, PAD_ID, PAD_ID, PAD_ID]]  # the last 5 tokens kept
    assert mask.tolist() == [[1, 0, 1, 1], [0, 0, 0, 0]]
    assert torch.allclose(old, torch.tensor([[-0.1, 0.0, -0.3, -0.4], [0.0] * 4]))
