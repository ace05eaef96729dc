"""`python -m moeswap.stdlib_model prepare DIR`: recipe.prepare (corpus, tokenizer, base, train.yaml)."""

import sys

from moeswap.stdlib_model.recipe import prepare

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "prepare":
        print("usage: python -m moeswap.stdlib_model prepare DIR", file=sys.stderr)
        sys.exit(2)
    print(prepare(sys.argv[2]))
