"""Writes examples/byo/math.jsonl's rows in verl's dataset layout (data_source, prompt, ability, reward_model,
extra_info), as verl's own examples/data_preprocess scripts do, to the parquet file named on the command line."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

rows = [json.loads(line) for line in open("examples/byo/math.jsonl")]
pq.write_table(pa.Table.from_pylist([
    {"data_source": "openai/gsm8k", "prompt": r["prompt"], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": {"split": "train", "index": i}}
    for i, r in enumerate(rows)]), sys.argv[1])
