"""``python -m lit_minimind.merge_lora BASE LORA``: one fp16 weight file, as MiniMind's ``merge_lora``.

``BASE`` is the model the adapters were trained on (``out/full_sft_768.pth``: any file holding MiniMind
weights), ``LORA`` the adapters (``out/lora_medical_768.pth``, ours or MiniMind's ``save_lora``). The
output holds every weight of the base in fp16 (MiniMind's keys, no adapter), each adapted Linear's weight
plus ``B @ A``: a plain MiniMind model file for ``generate``, ``--from_weight`` or MiniMind's scripts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lit_minimind.checkpoint.atomic import atomic_save
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import model_weights
from lit_minimind.cli.generate import load_model
from lit_minimind.cli.plain import description
from lit_minimind.errors import CheckpointError
from lit_minimind.model.lora import attach_lora, merged_state


def merge(base: str | Path, lora: str | Path, out: str | Path) -> int:
    """Write ``out``; returns the number of adapters merged."""
    model = load_model(str(base))
    try:
        adapters = attach_lora(model, model_weights(read_checkpoint(lora)))
    except ValueError as err:
        raise CheckpointError(f"{lora}: {err}") from None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_save(merged_state(model), Path(out), {"kind": "weights"})
    return adapters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.merge_lora", description=description(__doc__))
    parser.add_argument("base", help="the base model's weights (e.g. out/full_sft_768.pth)")
    parser.add_argument("lora", help="the LoRA adapters (e.g. out/lora_medical_768.pth)")
    parser.add_argument("--out", default=None, help="output file (default: LORA's name with _merged, beside it)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.lora).with_name(f"{Path(args.lora).stem}_merged.pth")
    try:
        adapters = merge(args.base, args.lora, out)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged {adapters} LoRA adapters of {args.lora} into {args.base}: wrote {out} (fp16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
