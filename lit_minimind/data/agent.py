"""MiniMind's agent RL records (``AgentRLDataset`` of ``dataset/lm_dataset.py``) over a jsonl file.

A record is ``{"conversations": [...], "gt": [...]}``: an SFT conversation (:mod:`lit_minimind.data.sft`) whose
system turn carries the ``tools`` offered (a JSON array or its string) and which ends with the assistant's
answer slot, and ``gt``, the ground truths the final answer must contain (strings or numbers; one per
expected tool call, since the reward compares the number of valid calls with ``len(gt)``). MiniMind drops the
last message and keeps the rest as the prompt; a record that would give it no tools or no ``gt`` is refused
here with one line naming the file and line (MiniMind fails later, or trains on ``tools=None``).

A sample is ``{"messages", "tools", "gt"}``, MiniMind's; :func:`collate_agent` keeps a batch as lists. Nothing
is drawn here: the thinking draw (``--thinking_ratio``, 0.1) is the rollout's, one per generation, from
Python's ``random`` (:mod:`lit_minimind.model.agent`), as ``rollout_single`` draws it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from lit_minimind.data.dataset import JsonlRecords, json_type
from lit_minimind.data.sft import check_sft_record
from lit_minimind.errors import DataError

__all__ = ["AgentDataset", "collate_agent", "check_agent_record", "THINKING_RATIO", "EMBEDDED_AGENT_DATA"]

THINKING_RATIO = 0.1  # train_agent.py's --thinking_ratio
EMBEDDED_AGENT_DATA = Path(__file__).with_name("agent_rl.jsonl")  # the demo: questions for the six tools


class AgentDataset(JsonlRecords, Dataset[dict[str, Any]]):
    """MiniMind's agent RL samples ``{"messages", "tools", "gt"}`` from a jsonl file (module docstring).

    Args:
        data_path: jsonl of ``{"conversations": [...], "gt": [...]}`` records (default: the embedded demo).
        cache_dir: where the record index is cached.
    """

    def __init__(self, data_path: str | os.PathLike[str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(data_path or EMBEDDED_AGENT_DATA, check_agent_record, cache_dir)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.record(index)
        messages, tools = prompt_of(record["conversations"])
        return {"messages": messages, "tools": tools, "gt": list(record["gt"])}


def prompt_of(conversations: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """MiniMind's ``parse_conversations``: the messages but the last (each copied as is, the system turn with its
    ``tools`` key), and the system turn's ``tools`` (JSON decoded)."""
    messages, tools = [], None
    for message in conversations:
        message = dict(message)
        if message.get("role") == "system" and message.get("tools"):
            tools = json.loads(message["tools"]) if isinstance(message["tools"], str) else message["tools"]
        messages.append(message)
    return messages[:-1], tools


def collate_agent(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """MiniMind's ``collate_fn``: ``{"messages": [...], "tools": [...], "gt": [...]}``, one entry per sample."""
    return {key: [sample[key] for sample in samples] for key in ("messages", "tools", "gt")}


def check_agent_record(record: dict, where: str) -> None:
    """DataError naming ``where`` unless ``record`` is a usable agent RL record (module docstring)."""
    if "gt" not in record:
        raise DataError(f'{where}: no "gt" (an agent RL record needs the list of ground truths its answer must contain)')
    gt = record["gt"]
    if not isinstance(gt, list):
        raise DataError(f'{where}: "gt" must be an array of strings or numbers, got {json_type(gt)}')
    for i, value in enumerate(gt):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f'{where}: gt[{i}] must be a string or a number, got {json_type(value)}')
    check_sft_record(record, where, need_answer=False)
    conversations = record["conversations"]
    if conversations[-1].get("role") != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer slot (MiniMind drops the last "
                        f"message), got role {conversations[-1].get('role')!r}")
    if len(conversations) < 2:
        raise DataError(f"{where}: no prompt (the only message is the assistant's)")
    _, tools = prompt_of(conversations)
    if not tools:
        raise DataError(f'{where}: no tools (the system message needs "tools": the tools offered to the model)')
    for i, tool in enumerate(tools):
        name = tool.get("function", {}).get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name:
            raise DataError(f'{where}: tools[{i}] has no "function": {{"name": ...}} (MiniMind reads tool names there)')
