"""Data: corpus, tokenizer, chat template, jsonl datasets, samplers and the DataModule."""
