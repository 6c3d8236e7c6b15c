"""Downstream multiple-choice evaluation: tasks (named, built-in or JSONL), lm-eval's scoring."""
