"""`python -m moeswap.stdlib_model prepare|check|evaluate|publish ...`: the recipe's steps that are not moeswap
commands (scripts/train-default-model.sh runs them in order with `moeswap train` and `moeswap quantize`).

  prepare WORK        corpus, tokenizer, initial K3-layout weights, train.yaml (recipe.prepare)
  check WORK          the finished run's first steps again from its manifest; exit 1 if they differ
  evaluate WORK       WORK/evaluation.json: held-out loss of WORK/trained and WORK/mxfp4, unigram baseline, samples
  publish WORK OUT    OUT: the MXFP4 model, the run's record and README.md (the model card)
  perplexity CORPUS MODEL [DENSE ...]
                      held-out loss and perplexity of MODEL on CORPUS (a `prepare` corpus directory) under each
                      --dense-weights choice given (default auto), as JSON
"""

import sys

USAGE = ("usage: python -m moeswap.stdlib_model prepare WORK | check WORK | evaluate WORK | publish WORK OUT | "
         "perplexity CORPUS MODEL [auto|compute|int8|int4 ...]")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "prepare":
        from moeswap.stdlib_model.recipe import prepare

        print(prepare(argv[1]))
    elif len(argv) == 2 and argv[0] == "check":
        from moeswap.stdlib_model.recipe import check

        ok, line = check(argv[1])
        print(line, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    elif len(argv) == 2 and argv[0] == "evaluate":
        from moeswap import jsonio
        from moeswap.stdlib_model.card import write_evaluation

        print(jsonio.dumps({k: v for k, v in write_evaluation(argv[1]).items() if k != "samples"}, indent=2))
    elif len(argv) == 3 and argv[0] == "publish":
        from moeswap.stdlib_model.card import publish

        print(publish(argv[1], argv[2]))
    elif len(argv) >= 3 and argv[0] == "perplexity":
        from moeswap import jsonio
        from moeswap.options import DENSE_WEIGHTS
        from moeswap.stdlib_model.evaluate import evaluate_models

        choices = argv[3:] or ["auto"]
        bad = [c for c in choices if c not in DENSE_WEIGHTS]
        if bad:
            print(f"perplexity: unknown --dense-weights {bad[0]!r} (expected {', '.join(DENSE_WEIGHTS)})",
                  file=sys.stderr)
            return 2
        report = evaluate_models(argv[1], {c: argv[2] for c in choices}, dense_weights={c: c for c in choices})
        print(jsonio.dumps(report, indent=2))
    else:
        print(USAGE, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
