"""Write the mixed workload of the chunked-prefill comparison: short prompts with
long answers (the decodes) and long prompts with short answers arriving among
them. Random token ids from the default model's ordinary vocabulary, seed 0."""

import json
import random
import sys

rng = random.Random(0)
lines = []
for i in range(20):
    long = i % 5 == 2                      # 4 long prompts among 16 short ones
    n = rng.randint(1200, 1800) if long else rng.randint(16, 64)
    ids = [rng.randrange(100, 49000) for _ in range(n)]
    lines.append({"prompt_token_ids": ids, "max_tokens": 8 if long else 160})
with open(sys.argv[1], "w") as f:
    for line in lines:
        f.write(json.dumps(line) + "\n")
