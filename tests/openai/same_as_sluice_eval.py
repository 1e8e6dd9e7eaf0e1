"""Checks that lm-evaluation-harness's multiple-choice accuracy through the endpoint equals
Sluice's own task evaluation of the same items (`sluice eval --metric choice`): acc and
acc_norm to rounding. Usage: same_as_sluice_eval.py LM_EVAL_RESULTS TASK SLUICE_REPORT

Sluice's report holds one answer per question with its score (1 when the most likely choice is
the right one); acc_norm is in its `extra`."""

import json
import sys

lm_path, task, sluice_path = sys.argv[1], sys.argv[2], sys.argv[3]
with open(lm_path) as f:
    lm = json.load(f)["results"][task]
with open(sluice_path) as f:
    sluice = json.load(f)
lm_acc, lm_norm = lm["acc,none"], lm["acc_norm,none"]
acc, norm = sluice["score"], sluice["extra"]["acc_norm"]
print(f"acc: lm_eval {lm_acc:.4f}, sluice eval {acc:.4f}; "
      f"acc_norm: lm_eval {lm_norm:.4f}, sluice eval {norm:.4f}; "
      f"{len(sluice['answers'])} questions")
if abs(lm_acc - acc) > 1e-9 or abs(lm_norm - norm) > 1e-9:
    print("FAIL: lm_eval through the endpoint and Sluice's own evaluation disagree")
    sys.exit(1)
print("lm_eval and sluice eval agree")
