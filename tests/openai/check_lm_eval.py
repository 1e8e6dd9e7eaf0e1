"""Prints lm-evaluation-harness's accuracy on the local task and fails unless it is plausible:
both metrics present, and acc at least 0.5 on four-choice questions (chance is 0.25; with 20
questions, guessing reaches 0.5 about once in a hundred runs). SmolLM2-135M-Instruct scores 0.65
through the endpoint. Usage: check_lm_eval.py RESULTS_JSON TASK"""

import json
import sys

path, task = sys.argv[1], sys.argv[2]
with open(path) as f:
    results = json.load(f)["results"][task]
acc, acc_norm = results.get("acc,none"), results.get("acc_norm,none")
print(f"lm_eval {task}: acc {acc} (± {results.get('acc_stderr,none')}), "
      f"acc_norm {acc_norm} (± {results.get('acc_norm_stderr,none')}), "
      f"{results.get('sample_len')} questions")
problems = []
if not isinstance(acc, (int, float)) or not isinstance(acc_norm, (int, float)):
    problems.append("acc or acc_norm is missing")
elif acc < 0.5:
    problems.append(f"acc {acc} is below 0.5: the endpoint's log-probabilities look wrong")
if problems:
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print("lm_eval results are plausible")
